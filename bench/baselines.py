"""Bare baseline servers the benchmarks compare against, measured in the same run.

- hello: a FastAPI hello-world (`async def`).
- insert: a bare SQLModel insert endpoint on SQLite (WAL, synchronous=NORMAL), one transaction per request.
"""

from __future__ import annotations

import os

from fastapi import FastAPI
from sqlalchemy import event
from sqlmodel import Field, Session, SQLModel, create_engine


class Row(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    name: str
    payload: str


def hello() -> FastAPI:
    app = FastAPI()

    @app.get("/healthz")
    async def ok() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/")
    async def root() -> dict[str, str]:
        return {"hello": "world"}

    return app


def insert() -> FastAPI:
    engine = create_engine(f"sqlite:///{os.environ['BENCH_DB']}", connect_args={"check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _pragmas(conn, _record):  # type: ignore[no-untyped-def]
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA busy_timeout=30000")

    SQLModel.metadata.create_all(engine)
    app = FastAPI()

    @app.get("/healthz")
    async def ok() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/rows", status_code=201)
    def create(row: Row) -> Row:
        with Session(engine) as session:
            session.add(row)
            session.commit()
            session.refresh(row)
            return row

    return app
