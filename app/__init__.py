"""HTTP layer: FastAPI app, API dialect routers, schemas, SSE, auth and the CLI."""
