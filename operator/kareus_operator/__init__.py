"""The Kareus operator: kopf handlers that drive a KareusJob through profile → optimize → train.

Handlers stay thin (read the spec with `kareus.spec`, call the core, write status); manifest
builders are pure functions returning dicts. The CRD itself is validated by the API server: the
tests run it on a real one (`devcluster.controlplane`).
"""
