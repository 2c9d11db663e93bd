"""The web chat page at / and its assets under /static/: static files shipped in the package
(tokenmill/server/static), open without the API key since they hold no secrets (auth.py)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

STATIC = Path(__file__).parent / "static"
# A fixed list, not a folder served as is: nothing else under the package can be fetched.
ASSETS = {"chat.js": "text/javascript", "chat.css": "text/css"}


def web_chat_routes() -> APIRouter:
    router = APIRouter(include_in_schema=False)

    @router.get("/")
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    for name, media_type in ASSETS.items():
        router.add_api_route(f"/static/{name}", _asset(name, media_type), methods=["GET"])
    return router


def _asset(name: str, media_type: str):
    async def asset() -> FileResponse:
        return FileResponse(STATIC / name, media_type=media_type)

    return asset
