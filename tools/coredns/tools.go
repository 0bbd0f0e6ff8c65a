//go:build tools

// The binary this module builds; the import only lets `go mod tidy` pin what it needs.
package tools

import _ "github.com/coredns/coredns"
