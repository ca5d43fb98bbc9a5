"""Stage 2 of a request, plan: read the JSON body (``body``) and decide route, adapter
version and variants in order (``planner``, with the weighted sticky ``split``)."""
