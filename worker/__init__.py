"""torchyard worker: what runs on every rank. Never imports the service, FastAPI or SQLModel."""
