"""What ties weight-checker to other software: vLLM (:mod:`.vllm`: the
plugins, the route glue, the API-key guard), Ray-hosted engines
(:mod:`.ray`)."""
