"""OpenAI-compatible HTTP server: protocol models, the FastAPI app, Prometheus metrics and the
`tokenmill serve` command. See docs/server.md."""
