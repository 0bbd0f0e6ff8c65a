//go:build tools

// The binary this module builds. Never compiled into anything: the import only lets
// `go mod tidy` pin every module the command needs.
package tools

import _ "sigs.k8s.io/kueue/cmd/kueue"
