"""The daemon's HTTP API (FastAPI). Everything it needs is passed in, so tests build it directly.

Reads (/metrics, /sd, job status) are open here (a web config's basic auth is enforced by the
HTTP front, ``server.py``); job mutations need ``Authorization: Bearer TOKEN`` (compared in
constant time). Rank registration is accepted from this node only: from loopback, or from the
address the connection arrived on (an agent on the node calling the daemon's node address), and
the PID it names must be a live local process.
Errors are JSON ``{"error": ..., "status": ...}`` with 400/401/403/404/409.
"""


import hmac
import os
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

from .._version import __version__
from ..rundir.safe_read import Unreadable, open_regular
from ..web.agent_socket import Peer
from .jobs import DuplicateJobError, JobError, JobManager, JobNotFound, JobStateConflict
from .ranks import RankRegistry, RegistrationRefused
from .store import JOB_STATES, StoreError

JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
LABEL_PATTERN = r"^[^/\\\x00-\x1f]{1,128}$"
HOST_PATTERN = r"^[A-Za-z0-9.:\[\]-]{1,253}$"


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
    verdict: dict[str, str] | None = None
    """The layer the first failure points at and its evidence, as ``ddpmon timeline`` ends."""
    failures: list[dict[str, Any]]
    summary: dict[str, Any]
    cancel_requested_at: float | None = None
    slurm_job_id: str | None = None
    """The Slurm job running it, under ``ddpmon daemon --backend slurm``."""


class JobList(BaseModel):
    jobs: list[JobView]


class RankRegistration(BaseModel):
    model_config = ConfigDict(extra="ignore")
    run: str = Field(pattern=LABEL_PATTERN)
    rank: int = Field(ge=0, le=1_000_000)
    local_rank: int = Field(default=0, ge=0, le=1_000_000)
    world_size: int | None = Field(default=None, ge=1, le=1_000_000)
    node: str = Field(default="", max_length=253)
    pid: int | None = Field(
        default=None, ge=1, le=2**31 - 1, description="The caller's own PID (default: it)."
    )
    port: int = Field(ge=1, le=65535)
    host: str = Field(default="127.0.0.1", pattern=HOST_PATTERN)
    job_id: str | None = Field(default=None, pattern=JOB_ID_PATTERN)
    slurm_job: str | None = Field(default=None, pattern=JOB_ID_PATTERN)
    slurm_user: str | None = Field(default=None, pattern=JOB_ID_PATTERN)
    slurm_partition: str | None = Field(default=None, pattern=JOB_ID_PATTERN)


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
        # Swagger UI and ReDoc load their code from a CDN: an offline cluster cannot, and an
        # operator does not expect the daemon to pull in a third party's scripts. The spec
        # stays at /openapi.json for any viewer.
        docs_url=None,
        redoc_url=None,
    )
    require_token = _token_check(token)
    _error_handlers(app)
    _node_routes(app, ranks, registry)
    _job_routes(app, jobs, require_token)
    _rank_routes(app, ranks)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    app.state.job_states = JOB_STATES
    return app


def _token_check(token: str) -> Any:
    """The dependency of the job routes that change something: the node's bearer token."""
    bearer = HTTPBearer(auto_error=False)

    def require_token(
        creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    ) -> None:
        given = creds.credentials if creds is not None else ""
        if not given or not hmac.compare_digest(given.encode(), token.encode()):
            raise HTTPException(
                401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
            )

    return require_token


def _caller(request: Request) -> Peer | None:
    """The calling process on the agent socket (``server.py`` sets it; None on TCP)."""
    peer = request.scope.get("extensions", {}).get("ddpmon.peer")
    return peer if isinstance(peer, Peer) else None


def _error_handlers(app: FastAPI) -> None:
    """Every error as ``{"error", "status"}``; validation errors as 400, not FastAPI's 422."""
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


def _node_routes(app: FastAPI, ranks: RankRegistry, registry: CollectorRegistry) -> None:
    """Node metrics, Prometheus discovery and health."""
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


def _job_routes(app: FastAPI, jobs: JobManager, require_token: Any) -> None:
    """The job gateway: submit and cancel (token), list, status, logs."""
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
        logs_dir = Path(job.job_dir, "logs")
        files = sorted(logs_dir.glob(f"*/attempt_*/{rank}/{stream}.log"))
        if not files:
            raise HTTPException(404, f"no {stream} log for rank {rank} of job {job_id!r}")
        try:
            data = _tail(logs_dir, files[-1], tail_bytes)
        except (OSError, Unreadable) as exc:
            raise HTTPException(404, f"{stream} log for rank {rank}: {exc}") from None
        return PlainTextResponse(data.decode("utf-8", "replace"))


def _rank_routes(app: FastAPI, ranks: RankRegistry) -> None:
    """Rank registration by the agents, over the agent socket (the caller's PID is checked)."""
    @app.post(
        "/api/v1/ranks",
        status_code=201,
        responses=_errors(400, 403, 409),
        tags=["discovery"],
    )
    def register(body: RankRegistration, request: Request) -> dict[str, Any]:
        """Called by an agent on start, over the agent socket: the PID must be the caller's
        own, the host this node's, and no other live process may hold the same rank."""
        try:
            ranks.register(body.model_dump(exclude_none=True), _caller(request))
        except RegistrationRefused as exc:
            raise HTTPException(exc.status, str(exc)) from None
        return {"registered": True, "run": body.run, "rank": body.rank}

    @app.delete(
        "/api/v1/ranks/{run}/{rank}",
        responses=_errors(403, 404),
        tags=["discovery"],
    )
    def deregister(
        run: Annotated[str, FastPath(max_length=128)],
        rank: Annotated[int, FastPath(ge=0, le=1_000_000)],
        request: Request,
    ) -> dict[str, Any]:
        """Called by an agent on close, over the agent socket: only the entry's own process
        (or anyone, once it died) removes it."""
        try:
            removed = ranks.deregister(run, rank, _caller(request))
        except RegistrationRefused as exc:
            raise HTTPException(exc.status, str(exc)) from None
        if not removed:
            raise HTTPException(404, f"rank {rank} of run {run!r} is not registered")
        return {"deregistered": True, "run": run, "rank": rank}


def _openapi(app: FastAPI) -> dict[str, Any]:
    """The OpenAPI spec, built once: validation errors are answered with 400
    (``_error_handlers``), not FastAPI's default 422."""
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


def _tail(logs_dir: Path, path: Path, size: int) -> bytes:
    """The last ``size`` bytes of a log the job wrote, if it is a regular file inside the job's
    logs dir: the job owns that dir, and a link it planted there must not make the API read
    another file (the daemon's token, another job's logs) for whoever may read logs."""
    real = Path(os.path.realpath(path))
    if not real.is_relative_to(os.path.realpath(logs_dir)) or path.is_symlink():
        raise Unreadable("a link out of the job's logs dir")
    with open_regular(real) as fh:
        fh.seek(0, 2)
        fh.seek(max(0, fh.tell() - size))
        return fh.read(size)

