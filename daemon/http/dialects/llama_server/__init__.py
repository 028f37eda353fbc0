"""llama-server's native routes: /completion, /tokenize, /detokenize, /apply-template, /embeddings, /infill, /rerank, /slots/{id}."""
