"""The HTTP app (``build_app``): routes, the API key, the one mapping of errors to statuses, and the metrics.

- ``POST /v1/chat/completions``, the encoder role: each item written to ``shared/<uuid>/encoder_cache.safetensors``
  (``vllm_cache.write_item``) unless this server wrote it already (another writer's file there: 409); the answer
  is a chat completion with ``ec_transfer_params``.
- ``POST /v1/embeddings``: pooled vectors (OpenAI's shape), or with ``return_tokens`` a safetensors payload.
- ``GET /health`` (503 once a forward fault says the device is broken), ``/v1/models``, ``/metrics``. The API key
  guards the ``/v1`` routes only, as vLLM's.
- JSON is parsed off the event loop, and media are read in the app's own threads once the queue has room for the
  request's items (``Batcher.reserve``): the encoder's thread gets bytes in memory and never waits on a network.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import reprlib
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any

import torch
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import TypeAdapter, ValidationError
from safetensors.torch import save
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from ..errors import CacheFolderError, EncoderClosedError, QwenVLVisionError, first_line
from ..outputs.handoff import EncodedItems, vllm_items
from ..outputs.vllm_cache import ENTRY_KEY, cache_lock, claim_cache_folder, entry, found_item, write_item
from ..results import ItemResult
from .batcher import Batcher
from .media import Item, MediaPolicy, RequestError, request_items

MEDIA_THREADS = 8  # URLs and files read at once; a URL read stops at its decode timeout (fetch)
STREAM = TypeAdapter(bool | None)  # vLLM's chat field, read as its model reads it


@dataclass(frozen=True)
class ServeSettings:
    """The command line's settings (``main.serve_settings``, which the tests use too)."""

    served_names: tuple[str, ...]  # the first is the name answers carry
    api_key: str | None
    shared: Path | None  # --ec-shared-storage: the encoder role's folder
    policy: MediaPolicy
    max_body: int
    body_timeout: float  # seconds a body under way may send nothing
    max_bodies: int  # request bodies and their media held at once (BodyBudget)
    max_items: int
    max_queue: int
    options: dict[str, Any]  # iter_encode's limits and pixel bounds


def error_response(request: Request, error: Exception) -> JSONResponse:
    """Every error's answer: the request's own fault 4xx, the server's 5xx, one line naming the item."""
    if isinstance(error, RequestError):
        status, headers = error.status, error.headers
    elif isinstance(error, HTTPException):  # an unknown route or method
        status, headers = error.status_code, error.headers
    elif isinstance(error, EncoderClosedError):
        status, headers = 503, None
    else:  # a project error that is a ValueError is the input's; any other (a forward's, the folder's, a bug) ours
        status, headers = (400 if isinstance(error, QwenVLVisionError) and isinstance(error, ValueError) else 500), None
    # One line even where an input's error quotes a decoder's multi-line text.
    message = " ".join(str(error.detail if isinstance(error, HTTPException) else error).split())
    if not isinstance(error, (QwenVLVisionError, HTTPException)):
        message = f"internal error, {first_line(error)}"
    kind = HTTPStatus(status).phrase.replace(" ", "").replace("-", "")
    kind += "" if kind.endswith("Error") else "Error"  # vLLM's names: BadRequestError, InternalServerError
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status, headers)


def placeholder_fields(e: dict[str, Any]) -> dict[str, Any]:
    """An item's ``ec_transfer_params`` metadata as a vLLM 0.33 producer reports it: the fields that size its
    placeholders (its parser's ``placeholder_metadata_fields``), which the proxy hands the decoder."""
    fields: dict[str, Any] = {f"{e['modality']}_grid_thw": e["grid_thw"]}
    if "timestamps" in e:
        fields["timestamps"] = e["timestamps"]
    if "second_per_grid_t" in e:
        fields["second_per_grid_ts"] = [e["second_per_grid_t"]]
    return fields


JSON_VALUE_BYTES = 64  # what a small parsed value (an empty list or dict, a short string) takes in CPython


@dataclass
class BodyBudget:
    """The request bodies and the media read for them (URLs', files') the app holds at once, in bytes. Each is held,
    parsed and its media decoded until its answer, so without it a burst of large bodies or media within uvicorn's
    connection limit could take the server's memory. Touched on the event loop only."""

    limit: int
    held: int = 0

    def charge(self, request: Request, size: int) -> None:
        """``size`` more bytes held for ``request``; over the limit, 503 with Retry-After (413 if it alone is), and
        what it holds given back at once: a request that fails holds nothing its siblings could use."""
        mine = getattr(request.state, "body_bytes", 0) + size
        held, full = self.held, self.held + size > self.limit
        if mine > self.limit or full:
            self.release(request)
        if mine > self.limit:  # a request that could never be held: a retry would be refused again
            raise RequestError(f"the request's body and media take more than --max-bodies-mib ({self.limit >> 20} "
                               f"MiB)", 413)
        if full:
            raise RequestError(f"the server holds {held / 2**20:.1f} MiB of request bodies and their media "
                               f"(--max-bodies-mib {self.limit >> 20}); try again shortly", 503, {"Retry-After": "1"})
        self.held += size
        request.state.body_bytes = mine

    def release(self, request: Request) -> None:
        """What ``request`` held, given back once it is answered (or refused)."""
        self.held -= getattr(request.state, "body_bytes", 0)
        request.state.body_bytes = 0


async def read_json(request: Request, limit: int, budget: BodyBudget, timeout: float) -> Any:
    """The body as JSON, refused (413) as soon as it is known to be over ``limit`` bytes; held within ``budget`` as
    its bytes arrive (a declared length is not charged: a client may declare more than it sends, or less), and its
    parsed values as a count of their marks gives them, before they are parsed. A client that sends nothing for
    ``timeout`` seconds mid-body is answered 408 (nginx's ``client_body_timeout``): stalled, it would hold its bytes
    of the budget, and a SIGTERM's wait, for as long as it liked (uvicorn sets no such bound)."""
    kind = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if kind != "application/json" and not (kind.startswith("application/") and kind.endswith("+json")):
        # A web page may post a form or text/plain to this host without asking first: refused, as FastAPI's JSON
        # bodies are (none given is taken as JSON there too).
        raise RequestError(f"the request body is {kind[:100]!r}, not JSON (Content-Type: application/json)", 415)
    over = RequestError(f"the request body is larger than --max-body-mib ({limit >> 20} MiB)", 413)
    if int(request.headers.get("content-length") or 0) > limit:
        raise over
    chunks, size, stream = [], 0, request.stream()
    try:
        while True:
            try:
                chunk = await asyncio.wait_for(anext(stream), timeout)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise RequestError(f"the request body sent nothing for --body-timeout ({timeout:g} s)", 408,
                                   {"Connection": "close"}) from None
            size += len(chunk)
            if size > limit:
                raise over
            budget.charge(request, len(chunk))
            chunks.append(chunk)
    except ClientDisconnect:  # the client's doing, not the server's fault: its answer goes unread
        raise RequestError("the client hung up before the request body ended") from None
    body = b"".join(chunks)
    # Parsed, each JSON value is a Python object of ~64 bytes where the body may spend two ("[],"): charged so, a
    # body of many small values cannot take twenty times its size.
    values = JSON_VALUE_BYTES * sum(map(body.count, (b",", b"[", b"{")))
    if size + values > limit:
        raise RequestError(f"the request body holds too many JSON values: parsed, they would take more than "
                           f"--max-body-mib ({limit >> 20} MiB)", 413)
    budget.charge(request, values)
    try:
        return await asyncio.to_thread(json.loads, body)
    except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than Python's stack
        raise RequestError(f"the request body is not JSON ({first_line(e, 200)})") from None


class Serving:
    """One app's state, on ``app.state.serving``; the routes are module functions that reach it through their
    request. FastAPI keeps every route's callable in process-wide caches (``fastapi.dependencies.models``), where
    closures over the encoder would keep it alive after its app."""

    def __init__(self, encoder: Any, settings: ServeSettings):
        self.encoder, self.settings = encoder, settings
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("qwenvl_vision_requests", "requests answered", ["route", "status"], registry=registry)
        items = Counter("qwenvl_vision_items_encoded", "items encoded (not those found written)", registry=registry)
        self.latency = Histogram("qwenvl_vision_request_seconds", "request latency", ["route"], registry=registry)
        queued = Gauge("qwenvl_vision_queue_items", "items waiting for the encoder, loading their media or "
                       "being encoded (--max-queue)", registry=registry)
        self.shared, self.tag = settings.shared, uuid.uuid4().hex
        if self.shared is not None:  # refused before serving: a folder holding another model's items
            claim_cache_folder(self.shared, encoder.identity(), self.tag)
        self.batcher = Batcher(encoder, settings.options, settings.max_queue, queued, items)
        self.bodies = BodyBudget(settings.max_bodies)
        # Media reads have threads of their own: slow URLs wait there, never in the threads every request parses in.
        self.media_threads = ThreadPoolExecutor(MEDIA_THREADS, thread_name_prefix="qwenvl-vision-media")
        # And the encoder role's folder its own: a writer holding its lock (a suspended embed) holds chat requests
        # there, not the threads every request parses in. One, as the lock lets one holder in at a time.
        self.cache_thread = ThreadPoolExecutor(1, thread_name_prefix="qwenvl-vision-cache")

    async def items_of(self, request: Request, role: bool) -> tuple[dict, list[Item]]:
        """The request's body and items; ``role``: the encoder role's (its items need uuids)."""
        settings = self.settings
        body = await read_json(request, settings.max_body, self.bodies, settings.body_timeout)
        if role and isinstance(body, dict):  # as vLLM's chat: the consumer would read another model's rows as its own
            if body.get("model") and body["model"] not in settings.served_names:
                raise RequestError(f"The model `{str(body['model'])[:200]}` does not exist.", 404)
            try:  # 1, "true" and "yes" stream; 0, "false" and "no" do not
                stream = STREAM.validate_python(body.get("stream"))
            except ValidationError:
                stream = True
            if stream:
                raise RequestError(f"stream {reprlib.repr(body['stream'])}: not served (the answer is one JSON "
                                   f"object)")
        found = await asyncio.to_thread(request_items, body, settings.policy, role)  # base64 off the loop
        if len(found) > settings.max_items:
            raise RequestError(f"messages: {len(found)} images and videos, more than --max-items {settings.max_items}")
        return body, found

    async def encoded(self, request: Request, found: list[Item], normalize: bool = False) -> list[ItemResult]:
        """The items' results, or the first failure as one line naming its item. A client that hangs up before its
        answer leaves nothing behind: its reads under way are cut, and its items the encoder has not reached are
        skipped (``Batcher.encode``), as vLLM aborts a request whose client went away."""
        work = asyncio.ensure_future(self.results(request, found, normalize))
        gone = asyncio.ensure_future(request.receive())  # the body is read: the next message is the hang-up
        try:
            done, _ = await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            work.cancel()  # done: a no-op
        if work not in done:
            raise RequestError("the client hung up before its answer")
        return work.result()

    async def results(self, request: Request, found: list[Item], normalize: bool) -> list[ItemResult]:
        with self.batcher.reserve(len(found)):  # a request the queue has no room for reads none of its media
            # At most a pool's worth of its own reads at once: what keeps a read waiting for a thread is then the
            # other requests' reads (the 503's claim), never its own siblings' (which retrying would meet again).
            slots = asyncio.Semaphore(MEDIA_THREADS)
            reads = [asyncio.ensure_future(self.loaded(request, item, slots)) for item in found]
            try:
                await asyncio.gather(*reads)
            finally:  # one item failed: its siblings' reads not yet started leave the media threads' queue
                for read in reads:
                    read.cancel()
            futures = self.batcher.submit([item.file for item in found], normalize)
        results = await asyncio.gather(*futures)
        for result in results:
            if not result.ok:
                raise result.error_class(result.error)
        return results

    async def loaded(self, request: Request, item: Item, slots: asyncio.Semaphore) -> None:
        """The item's bytes read (a URL's, a file's) in the media threads and charged to the request's bodies: the
        encoder's thread never waits on a network or a file. A read is bounded by fetch's own deadline (a file by its
        end); one still waiting for a thread after the decode timeout is dropped, and its request answered 503: the
        server was busy, the item may be fine."""
        if item.file.fetched:
            return
        await slots.acquire()
        timeout = self.settings.policy.timeout_s
        # At most what the bodies' bound allows one request: charged once read, a larger read would overshoot it.
        read = self.media_threads.submit(item.file.read, min(self.settings.options["decode_bytes"],
                                                             self.settings.max_bodies))
        reading = asyncio.wrap_future(read)
        try:
            await asyncio.wait([reading], timeout=timeout)  # unlike wait_for, it leaves a read under way going
            if read.cancel():  # it never started, and now never will
                raise RequestError(f"{item.label}: not read: every media thread was busy for the decode timeout "
                                   f"({timeout:g} s); try again shortly", 503, {"Retry-After": "1"})
            data = await reading
        finally:  # this request answered without it (a sibling failed): a read still queued never runs (cancelled
            read.cancel()  # here, at once: ``reading``'s cancel reaches it only on the loop's next pass), one under
            reading.cancel()  # way is cut
            if (connections := self.settings.policy.reading.get(item.file)) is not None:
                connections.cut()
        self.bodies.charge(request, len(data))
        slots.release()  # not by a failed read: its request is answered; no sibling starts a read then

    def written(self, item: Item) -> dict | None:
        """The entry of the item this server wrote under the item's uuid (its metadata says what a request needs),
        touched as ``write_item`` touches what it finds; None if there is none. Another writer's file there, or an
        item of the other modality, is a 409: the consumer would load it, which no answer can describe."""
        try:
            metadata = found_item(self.shared, item.uuid)
        except CacheFolderError as e:  # another writer's file at its name
            raise RequestError(f"{item.label}: {e}", 409) from None
        if metadata is not None and ENTRY_KEY not in metadata:
            raise RequestError(f"{item.label}: {self.shared / item.uuid} holds an item this server did not write; "
                               f"give the item another uuid, or remove that folder", 409)
        found = None if metadata is None else json.loads(metadata[ENTRY_KEY])
        if found is not None and found["modality"] != item.modality:  # no answer could describe it as this item
            raise RequestError(f"{item.label}: uuid {item.uuid!r} names a {found['modality']} item written before, "
                               f"not this {item.modality}; give the item another uuid", 409)
        return found

    def present(self, found: list[Item]) -> dict[str, dict]:
        with cache_lock(self.shared):  # a prune removes nothing between the read and the touch
            return {item.uuid: e for item in found if (e := self.written(item)) is not None}

    def write(self, found: list[Item], results: list[ItemResult]) -> dict[str, dict]:
        entries = {}
        with cache_lock(self.shared):  # a prune removes nothing while items are written
            for item, r in zip(found, results):
                try:
                    (rows,) = vllm_items(EncodedItems([r.embedding], [r.grid_thw], [r.deepstack], item.modality,
                                                      self.encoder.family, [r.video_info]))
                except QwenVLVisionError as e:
                    raise RequestError(f"{item.label}: {e}") from None
                entries[item.uuid] = {k: v for k, v in entry(item.uuid, rows).items() if k != "id"}
                metadata = {ENTRY_KEY: json.dumps(entries[item.uuid])}
                if not write_item(self.shared, item.uuid, rows.rows, self.tag, metadata):
                    # Another request's file got there first: the consumer loads that one, so the answer is its.
                    entries[item.uuid] = self.written(item)
        return entries


def serving(request: Request) -> Serving:
    return request.app.state.serving


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI):
    s = app.state.serving
    try:
        yield
    finally:
        s.media_threads.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(s.batcher.close)
        s.cache_thread.shutdown(wait=False)  # uvicorn ends the lifespan once every request is answered
        s.encoder.close()


async def authorized(request: Request) -> None:
    key = serving(request).settings.api_key
    given = request.headers.get("authorization", "").encode()
    if key and not hmac.compare_digest(given, f"Bearer {key}".encode()):
        raise RequestError("a valid API key is required (Authorization: Bearer KEY)", 401)


async def measure(request: Request, call_next):
    s, start, status = serving(request), time.perf_counter(), 500
    try:
        response = await call_next(request)
        status = response.status_code
        return response
    finally:
        s.bodies.release(request)  # its answer is made: the body, what was parsed from it and its media are dropped
        route = getattr(request.scope.get("route"), "path", "other")  # the matched route; unknown paths: one label
        s.requests.labels(route, str(status)).inc()
        s.latency.labels(route).observe(time.perf_counter() - start)


public = APIRouter()
router = APIRouter(prefix="/v1", dependencies=[Depends(authorized)])  # vLLM's key guards /v1 alone


@public.get("/health")
async def health(request: Request) -> dict:
    batcher = serving(request).batcher
    if batcher.fault is not None or batcher.stopping:  # as vLLM's health answers for a dead engine
        raise RequestError(batcher.fault or "the server is shutting down", 503)
    return {}


@public.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(serving(request).registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/models")
async def models(request: Request) -> dict:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "qwenvl-vision"}
                                       for name in serving(request).settings.served_names]}


@router.post("/chat/completions")
async def chat(request: Request) -> dict:
    s = serving(request)
    if s.shared is None:
        raise RequestError("this server has no encoder role: start it with --ec-shared-storage PATH")
    _, found = await s.items_of(request, True)
    loop = asyncio.get_running_loop()
    entries = await loop.run_in_executor(s.cache_thread, s.present, found)
    todo = list({item.uuid: item for item in found if item.uuid not in entries}.values())  # each uuid once
    if todo:
        results = await s.encoded(request, todo)
        entries.update(await loop.run_in_executor(s.cache_thread, s.write, todo, results))
    transfer: dict[str, dict] = {}
    for i, item in enumerate(found):
        transfer.setdefault(item.uuid, {"modality": item.modality, "metadata": placeholder_fields(
            entries[item.uuid]), "item_indices": []})["item_indices"].append(i)
    tokens = sum(entries[item.uuid]["tokens"] for item in found)
    return {"id": f"chatcmpl-{request.headers.get('x-request-id') or uuid.uuid4().hex}",
            "object": "chat.completion", "created": int(time.time()), "model": s.settings.served_names[0],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": "length"}],
            "usage": {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens},
            "ec_transfer_params": transfer}


@router.post("/embeddings")
async def embeddings(request: Request) -> Any:
    s = serving(request)
    body, found = await s.items_of(request, False)
    form = "float" if body.get("encoding_format") is None else body["encoding_format"]  # null: OpenAI's default
    # What the answer would silently not honour (vLLM's and OpenAI's other fields) is refused.
    # embed_dtype and endianness: vLLM's names, honoured by base64 alone (the bytes' type and order).
    served = {"dimensions": (None,), "embed_dtype": (None, "float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"),
              "endianness": (None, "native", "big", "little")}
    if form == "base64":
        served.update(embed_dtype=(None, "float32"), endianness=(None, "native", "little"))
    for name, values in served.items():
        if body.get(name) not in values:
            raise RequestError(f"{name} {reprlib.repr(body[name])}: not served (vectors are float32, little-endian, "
                               f"of the tower's width)")
    given = {k: body[k] for k in ("normalize", "use_activation") if body.get(k) is not None}  # vLLM 0.33's name, ours
    normalize, tokens = next(iter(given.values()), False), body.get("return_tokens", False)
    if form not in ("float", "base64") or any(not isinstance(v, bool) for v in given.values()) or \
            len(set(given.values())) > 1 or not isinstance(tokens, bool):
        raise RequestError(f"encoding_format {reprlib.repr(form)} / {reprlib.repr(given)} / return_tokens "
                           f"{reprlib.repr(tokens)}: float or base64 / normalize (or use_activation) a boolean / a "
                           f"boolean")
    if not found:
        raise RequestError("messages: no image or video item to embed")
    results = await s.encoded(request, found, normalize)
    if tokens:
        tensors = {}
        for i, r in enumerate(results):
            tensors[f"{i}.embeddings"] = r.embedding.cpu().contiguous()
            tensors[f"{i}.grid_thw"] = torch.tensor(r.grid_thw, dtype=torch.int64)
            tensors.update({f"{i}.deepstack.{level}": t.cpu().contiguous() for level, t in enumerate(r.deepstack)})
        return Response(await asyncio.to_thread(save, tensors), media_type="application/vnd.safetensors")
    data = []
    for i, r in enumerate(results):
        vector = r.pooled.float().cpu()
        value = base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode() if form == "base64" \
            else vector.tolist()
        data.append({"object": "embedding", "index": i, "embedding": value})
    tokens = sum(r.embedding.shape[0] for r in results)
    return {"object": "list", "data": data, "model": s.settings.served_names[0],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def build_app(encoder: Any, settings: ServeSettings) -> FastAPI:
    """The app serving ``encoder``, which its lifespan's end closes once the queue has drained."""
    app = FastAPI(lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.serving = Serving(encoder, settings)
    for error in (QwenVLVisionError, HTTPException, Exception):
        app.add_exception_handler(error, error_response)
    app.middleware("http")(measure)
    app.include_router(public)
    app.include_router(router)
    return app
