"""Tool calling: recognising the calls in a model's output (parse)."""
