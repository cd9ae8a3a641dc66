"""The MooncakeServing API: pydantic models of spec and status, the single source of truth (no I/O).

The CRD schema (`api.crd`), the builders (`mooncake_operator.build`) and the engine command line are all
derived from these models. Fields are snake_case in Python and camelCase on the wire; unknown fields are
rejected, so a typo in a manifest is an error, not a silently ignored setting. Import the module that
defines a name (`api.resource.parse_resource`, `api.spec.MooncakeServingSpec`): this package module
imports nothing, so a command that needs one constant does not build every model.
"""
