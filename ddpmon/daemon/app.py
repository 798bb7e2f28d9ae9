"""The daemon's HTTP API (FastAPI). Everything it needs is passed in, so tests build it directly.

Reads (/metrics, /sd, job status) are open here (a web config's basic auth is enforced by the
HTTP front, ``server.py``); job mutations need ``Authorization: Bearer TOKEN`` (compared in
constant time). Rank registration is accepted from this node only: from loopback, or from the
address the connection arrived on (an agent on the node calling the daemon's node address), and
the PID it names must be a live local process.
Errors are JSON ``{"error": ..., "status": ...}`` with 400/401/403/404/409.
"""


import hmac
import re
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi import Path as FastPath
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from .jobs import DuplicateJobError, JobError, JobManager, JobNotFound, JobStateConflict
from .ranks import RankRegistry
from .store import JOB_STATES, StoreError

JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
LABEL_PATTERN = r"^[^/\\\x00-\x1f]{1,128}$"
HOST_PATTERN = r"^[A-Za-z0-9.:\[\]-]{1,253}$"
LOOPBACK = {"127.0.0.1", "::1", "localhost"}


class ErrorBody(BaseModel):
    error: str
    status: int
    details: list[dict[str, Any]] | None = None


class JobSubmit(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(pattern=JOB_ID_PATTERN, description="Job id; also the run id of its ranks.")
    entrypoint: str = Field(min_length=1, max_length=64, description="A key of the allow-list.")
    nproc: int = Field(ge=1, le=1024, description="Processes (ranks) on this node.")
    args: list[str] = Field(default_factory=list, max_length=10_000)


class JobView(BaseModel):
    id: str
    entrypoint: str
    nproc: int
    args: list[str]
    state: Literal["PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "LOST"]
    reason: str | None = None
    created_at: float
    started_at: float | None = None
    ended_at: float | None = None
    pid: int | None = None
    exit_code: int | None = None
    ports: list[int]
    run_path: str
    job_dir: str
    ranks: dict[str, dict[str, Any]]
    first_failure: dict[str, Any] | None = None
    failures: list[dict[str, Any]]
    summary: dict[str, Any]
    cancel_requested_at: float | None = None


class JobList(BaseModel):
    jobs: list[JobView]


class RankRegistration(BaseModel):
    model_config = ConfigDict(extra="ignore")
    run: str = Field(pattern=LABEL_PATTERN)
    rank: int = Field(ge=0, le=1_000_000)
    local_rank: int = Field(default=0, ge=0, le=1_000_000)
    world_size: int | None = Field(default=None, ge=1, le=1_000_000)
    node: str = Field(default="", max_length=253)
    pid: int = Field(ge=1, le=2**31 - 1)
    port: int = Field(ge=1, le=65535)
    host: str = Field(default="127.0.0.1", pattern=HOST_PATTERN)
    job_id: str | None = Field(default=None, pattern=JOB_ID_PATTERN)


class SdGroup(BaseModel):
    targets: list[str]
    labels: dict[str, str]


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorBody} for code in codes}


def _view(job: Any) -> dict[str, Any]:
    doc = asdict(job)
    doc["run_path"] = str(Path(job.run_dir) / job.id) if job.run_dir else ""
    return doc


def create_app(
    *,
    jobs: JobManager,
    ranks: RankRegistry,
    registry: CollectorRegistry,
    token: str,
) -> FastAPI:
    app = FastAPI(
        title="ddpmon daemon",
        version=__version__,
        description="Node metrics, Prometheus discovery of live ranks, and job submission.",
    )
    bearer = HTTPBearer(auto_error=False)

    def require_token(
        creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    ) -> None:
        given = creds.credentials if creds is not None else ""
        if not given or not hmac.compare_digest(given.encode(), token.encode()):
            raise HTTPException(
                401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
            )

    def require_loopback(request: Request) -> None:
        host = request.client.host if request.client else ""
        server = request.scope.get("server") or ("", 0)
        same_host = bool(host) and host == str(server[0])
        if host not in LOOPBACK and host != "testclient" and not same_host:
            raise HTTPException(403, "rank registration is accepted from this node only")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            {"error": str(exc.detail), "status": exc.status_code},
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(StoreError)
    async def store_error(_: Request, exc: StoreError) -> JSONResponse:
        return JSONResponse({"error": str(exc), "status": 500}, status_code=500)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        details = [
            {"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg", ""))}
            for e in exc.errors()
        ]
        summary = "; ".join(f"{'.'.join(d['loc'])}: {d['msg']}" for d in details[:5])
        return JSONResponse(
            {"error": f"invalid request: {summary}", "status": 400, "details": details},
            status_code=400,
        )

    @app.get("/metrics", response_class=PlainTextResponse, tags=["metrics"])
    def metrics() -> Response:
        """Node metrics: GPUs (NVML), host (psutil), job states."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/sd", response_model=list[SdGroup], tags=["discovery"])
    def sd() -> list[dict[str, Any]]:
        """Prometheus http_sd targets: one per live rank registered on this node."""
        return ranks.http_sd()

    @app.get("/healthz", tags=["meta"])
    def healthz() -> dict[str, str]:
        return {"status": "ok", "version": __version__}

    @app.post(
        "/api/v1/jobs",
        status_code=201,
        response_model=JobView,
        responses=_errors(400, 401, 409),
        dependencies=[Depends(require_token)],
        tags=["jobs"],
    )
    def submit(body: JobSubmit) -> dict[str, Any]:
        """Launch an allow-listed entry point under torchrun (PENDING while at capacity)."""
        try:
            return _view(jobs.submit(body.id, body.entrypoint, body.nproc, body.args))
        except DuplicateJobError:
            raise HTTPException(409, f"job {body.id!r} already exists") from None
        except JobError as exc:
            raise HTTPException(400, str(exc)) from None

    @app.get("/api/v1/jobs", response_model=JobList, tags=["jobs"])
    def list_jobs(
        state: Annotated[
            Literal["PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "LOST"] | None,
            Query(),
        ] = None,
    ) -> dict[str, Any]:
        found = [_view(j) for j in jobs.list_jobs() if state is None or j.state == state]
        return {"jobs": found}

    @app.get("/api/v1/jobs/{job_id}", response_model=JobView, responses=_errors(404), tags=["jobs"])
    def status(job_id: Annotated[str, FastPath(max_length=256)]) -> dict[str, Any]:
        try:
            return _view(jobs.get(job_id))
        except JobNotFound:
            raise HTTPException(404, f"no job {job_id!r}") from None

    @app.delete(
        "/api/v1/jobs/{job_id}",
        status_code=202,
        response_model=JobView,
        responses=_errors(401, 404, 409),
        dependencies=[Depends(require_token)],
        tags=["jobs"],
    )
    def cancel(job_id: Annotated[str, FastPath(max_length=256)]) -> dict[str, Any]:
        """SIGTERM to the job's process group; SIGKILL to all its processes after the grace."""
        try:
            return _view(jobs.cancel(job_id))
        except JobNotFound:
            raise HTTPException(404, f"no job {job_id!r}") from None
        except JobStateConflict as exc:
            raise HTTPException(409, str(exc)) from None

    @app.get(
        "/api/v1/jobs/{job_id}/logs",
        response_class=PlainTextResponse,
        responses=_errors(400, 404),
        tags=["jobs"],
    )
    def logs(
        job_id: str,
        rank: Annotated[int, Query(ge=0, le=1024)] = 0,
        stream: Annotated[Literal["stdout", "stderr"], Query()] = "stderr",
        tail_bytes: Annotated[int, Query(ge=1, le=1_000_000)] = 65536,
    ) -> Response:
        """The tail of one rank's stdout or stderr (torchrun's per-rank log file)."""
        try:
            job = jobs.get(job_id)
        except JobNotFound:
            raise HTTPException(404, f"no job {job_id!r}") from None
        files = sorted(Path(job.job_dir, "logs").glob(f"*/attempt_*/{rank}/{stream}.log"))
        if not files:
            raise HTTPException(404, f"no {stream} log for rank {rank} of job {job_id!r}")
        with files[-1].open("rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - tail_bytes))
            data = fh.read()
        return PlainTextResponse(data.decode("utf-8", "replace"))

    @app.post(
        "/api/v1/ranks",
        status_code=201,
        responses=_errors(400, 403),
        dependencies=[Depends(require_loopback)],
        tags=["discovery"],
    )
    def register(body: RankRegistration) -> dict[str, Any]:
        """Called by an agent on start; its PID must be alive on this node."""
        try:
            ranks.register(body.model_dump())
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        return {"registered": True, "run": body.run, "rank": body.rank}

    @app.delete(
        "/api/v1/ranks/{run}/{rank}",
        responses=_errors(403, 404),
        dependencies=[Depends(require_loopback)],
        tags=["discovery"],
    )
    def deregister(
        run: Annotated[str, FastPath(max_length=128)],
        rank: Annotated[int, FastPath(ge=0, le=1_000_000)],
    ) -> dict[str, Any]:
        if not ranks.deregister(run, rank):
            raise HTTPException(404, f"rank {rank} of run {run!r} is not registered")
        return {"deregistered": True, "run": run, "rank": rank}

    def openapi() -> dict[str, Any]:
        # Validation errors are answered with 400 (handler above), not FastAPI's default 422.
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    responses = op.get("responses", {})
                    if responses.pop("422", None) is not None:
                        responses.setdefault(
                            "400",
                            {
                                "description": "Invalid request",
                                "content": {
                                    "application/json": {
                                        "schema": {"$ref": "#/components/schemas/ErrorBody"}
                                    }
                                },
                            },
                        )
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                comps.pop(name, None)
            comps.setdefault("ErrorBody", ErrorBody.model_json_schema())
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.state.job_states = JOB_STATES
    return app


def job_id_valid(job_id: str) -> bool:
    return re.fullmatch(JOB_ID_PATTERN, job_id) is not None
