"""Pure builders: a validated MooncakeServing -> the manifests of every child object (no I/O, no client).

One module per object family (`names` is shared by the builders, the planner, the observer and the watch
cache); `manifests.render_all` lists every child in apply order. The replicas' command line, environment
and store config come from `engine_args`, the module the sandbox uses too.
"""
