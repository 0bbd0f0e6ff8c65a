"""The Kareus operator: kopf handlers that drive a KareusJob through profile → optimize → train.

Handlers stay thin (read the spec with `kareus.spec`, call the core, write status); manifest
builders are pure functions returning dicts; `crdschema` validates objects against the CRD the way
the API server does (used by the development cluster and the CRD agreement tests).
"""
