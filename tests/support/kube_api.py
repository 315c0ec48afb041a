"""A test double of the Kubernetes API server on 127.0.0.1 that the unmodified official client
talks to over HTTP (kubeconfig ``server: http://127.0.0.1:PORT``, token auth).

It serves only what a training backend needs: create/get/list/watch/delete/deletecollection/patch/replace of
batch/v1 Jobs, v1 Pods and Services, coordination.k8s.io/v1 Leases, pod logs, pod eviction,
namespaces (read) and SelfSubjectAccessReviews (answered from an allow-list). Behind it: the
object store (``kube_store``), a Job controller and a pod runner that starts each pod's command
as a local process (``kube_pods``). Use the :func:`kube_api` fixture or :class:`KubeAPI` as a
context manager; closing it kills every pod process.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NamedTuple
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

from support.kube_jobs import JobController
from support.kube_objects import RESOURCES, KubeError
from support.kube_pods import PodRunner
from support.kube_store import Store, now

# /api/v1/namespaces/NS/pods/NAME/log, /apis/batch/v1/jobs (all namespaces), …
_PATH = re.compile(
    r"^/(?:api/v1|apis/(?P<group>[\w.]+)/v1)(?:/namespaces/(?P<ns>[\w.-]+))?"
    r"/(?P<plural>[\w]+)(?:/(?P<name>[\w.-]+)(?:/(?P<sub>\w+))?)?$"
)
DEFAULT_WATCH_TIMEOUT_S = 300  # a watch without timeoutSeconds (the real server picks 30-60 min)


def merge_patch(target, patch):
    """RFC 7386 JSON merge patch (strategic merge patches are applied the same way: lists are
    replaced whole, which is all a backend's label/annotation/parallelism patches need)."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def json_patch(target: dict, ops: list[dict]) -> dict:
    """RFC 6902 add/replace/remove/test, enough for ``[{"op": "replace", "path": …}]`` patches."""
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
        node = target
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
        key = int(last) if isinstance(node, list) and last != "-" else last
        if op["op"] == "add" and isinstance(node, list):
            node.insert(len(node) if key == "-" else key, op["value"])
        elif op["op"] in ("add", "replace"):
            node[key] = op["value"]
        elif op["op"] == "remove":
            del node[key]
        elif op["op"] == "test" and node.get(key) != op["value"]:
            raise KubeError(422, "Invalid", f"test operation failed at {op['path']}")
    return target


class KubeAPI:
    """The double: a server, its store, Job controller and pod runner.

    ``allow``: the SelfSubjectAccessReview allow-list, (verb, group, resource) triples where
    ``"*"`` matches anything; resource may be ``"pods/log"``. ``namespaces``: those that exist.
    """

    def __init__(
        self,
        workdir: Path,
        namespaces=("default",),
        allow=(("*", "*", "*"),),
        history: int = 1000,
        token: str | None = None,
    ):
        self.workdir = Path(workdir)
        self.token = token or uuid.uuid4().hex
        self.namespaces = set(namespaces)
        self.allow = set(allow)
        self.store = Store(history)
        self.controller = JobController(self.store)
        self.runner = PodRunner(self.store, self.workdir / "pods")
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), name="kube-api", daemon=True)
        self._thread.start()

    def kubeconfig(self, namespace: str = "default") -> Path:
        """A kubeconfig file naming this server with a bearer token (as a cluster's would)."""
        path = self.workdir / "kubeconfig"
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "double",
                    "clusters": [{"name": "double", "cluster": {"server": self.url}}],
                    "users": [{"name": "tester", "user": {"token": self.token}}],
                    "contexts": [
                        {"name": "double", "context": {"cluster": "double", "user": "tester", "namespace": namespace}}
                    ],
                }
            )
        )
        return path

    def client(self):
        """An official ``kubernetes.client.ApiClient`` configured from :meth:`kubeconfig`."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig()))

    def allowed(self, attrs: dict) -> bool:
        resource = attrs.get("resource", "") + (f"/{attrs['subresource']}" if attrs.get("subresource") else "")
        want = (attrs.get("verb", ""), attrs.get("group", ""), resource)
        return any(all(a in ("*", w) for a, w in zip(rule, want)) for rule in self.allow)

    def close(self) -> None:
        """Stop serving, end every watch, kill every pod process (nothing outlives the double)."""
        self.store.close()
        self.controller.close()
        self.runner.close()
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(10)

    def __enter__(self) -> KubeAPI:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@pytest.fixture
def kube_api(tmp_path):
    with KubeAPI(tmp_path / "kube") as api:
        yield api


_ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
_NAMESPACE = re.compile(r"^/api/v1/namespaces/([\w.-]+)$")


class _Call(NamedTuple):
    """One request to a resource path: ``name`` None for the collection."""

    plural: str
    ns: str | None
    name: str | None
    query: dict[str, str]
    body: dict | list | None


class _Handler(BaseHTTPRequestHandler):
    """The double's HTTP side; :func:`_handler` binds it to one :class:`KubeAPI` (``api``)."""

    api: KubeAPI
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # requests are not test output
        pass

    def do_GET(self):
        self._serve("GET")

    def do_POST(self):
        self._serve("POST")

    def do_PUT(self):
        self._serve("PUT")

    def do_PATCH(self):
        self._serve("PATCH")

    def do_DELETE(self):
        self._serve("DELETE")

    def _serve(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            if self.headers.get("Authorization") != f"Bearer {self.api.token}":
                raise KubeError(401, "Unauthorized", "Unauthorized")
            url = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            body = json.loads(raw) if raw.strip() else None
            self._route(method, unquote(url.path), query, body)
        except KubeError as e:
            self._json(e.code, e.status())
        except (ValueError, KeyError, TypeError, IndexError) as e:
            self._json(400, KubeError(400, "BadRequest", f"bad request: {e}").status())

    def _route(self, method, path, query, body):
        if path == _ACCESS_REVIEWS and method == "POST":
            return self._access_review(body)
        m = _NAMESPACE.match(path)
        if m and method == "GET":
            return self._namespace(m.group(1))
        m = _PATH.match(path)
        if not m or m["plural"] not in RESOURCES or (m["group"] or "") != RESOURCES[m["plural"]].group:
            raise KubeError(404, "NotFound", f"the server could not find the requested resource ({method} {path})")
        call = _Call(m["plural"], m["ns"], m["name"], query, body)
        if call.ns is not None and call.ns not in self.api.namespaces and method == "POST":
            raise KubeError(
                404, "NotFound", f'namespaces "{call.ns}" not found', {"name": call.ns, "kind": "namespaces"}
            )
        if call.name is None:
            target = "collection" if call.ns or method == "GET" else None  # create/deletecollection: in a namespace
        elif m["sub"] in ("log", "eviction"):
            target = m["sub"] if call.plural == "pods" else None
        else:
            target = "object" if m["sub"] in (None, "status") else None
        verb = _ROUTES.get((target, method))
        if verb is None:
            raise KubeError(405, "MethodNotAllowed", f"{method} is not supported on {path} by this double")
        return verb(self, call)

    def _access_review(self, body):
        attrs = (body.get("spec") or {}).get("resourceAttributes") or {}
        ok = self.api.allowed(attrs)
        status = {"allowed": ok, **({} if ok else {"reason": "not in the double's allow-list"})}
        review = {
            **body,
            "kind": "SelfSubjectAccessReview",
            "apiVersion": "authorization.k8s.io/v1",
            "metadata": {"creationTimestamp": now()},
            "status": status,
        }
        return self._json(201, review)

    def _namespace(self, name: str):
        if name not in self.api.namespaces:
            raise KubeError(404, "NotFound", f'namespaces "{name}" not found', {"name": name, "kind": "namespaces"})
        namespace = {
            "kind": "Namespace",
            "apiVersion": "v1",
            "metadata": {"name": name, "uid": name, "resourceVersion": "1"},
            "spec": {"finalizers": ["kubernetes"]},
            "status": {"phase": "Active"},
        }
        return self._json(200, namespace)

    # -- the verbs on a resource path (see _ROUTES)
    def _create(self, c: _Call):
        return self._json(201, self.api.store.create(c.plural, c.ns, c.body or {}))

    def _list_or_watch(self, c: _Call):
        if c.query.get("watch") in ("true", "1"):
            return self._watch(c.plural, c.ns, c.query)
        items, rv = self.api.store.list(c.plural, c.ns, c.query.get("labelSelector"), c.query.get("fieldSelector"))
        resource = RESOURCES[c.plural]
        listed = {
            "kind": resource.kind + "List",
            "apiVersion": resource.api_version,
            "metadata": {"resourceVersion": rv},
            "items": items,
        }
        return self._json(200, listed)

    def _delete_collection(self, c: _Call):  # by label/field selector
        store = self.api.store
        for obj in store.list(c.plural, c.ns, c.query.get("labelSelector"), c.query.get("fieldSelector"))[0]:
            store.delete(c.plural, c.ns, obj["metadata"]["name"], c.query.get("propagationPolicy"))
        return self._json(200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"})

    def _log(self, c: _Call):
        return self._text(200, self.api.runner.logs(self.api.store.get(c.plural, c.ns, c.name), c.query))

    def _evict(self, c: _Call):
        self.api.runner.evict(c.ns, c.name)
        return self._json(201, {**(c.body or {}), "kind": "Eviction", "apiVersion": "policy/v1"})

    def _get(self, c: _Call):
        return self._json(200, self.api.store.get(c.plural, c.ns, c.name))

    def _delete(self, c: _Call):
        body = c.body or {}
        policy = c.query.get("propagationPolicy") or body.get("propagationPolicy")
        if policy is None and body.get("orphanDependents") is not None:
            policy = "Orphan" if body["orphanDependents"] else "Background"
        grace = c.query.get("gracePeriodSeconds", body.get("gracePeriodSeconds"))
        return self._json(
            200, self.api.store.delete(c.plural, c.ns, c.name, policy, None if grace is None else int(grace))
        )

    def _replace(self, c: _Call):
        body = c.body
        expect = (body.get("metadata") or {}).get("resourceVersion")
        return self._json(
            200,
            self.api.store.update(c.plural, c.ns, c.name, lambda o: (o.clear(), o.update(body)), expect, client=True),
        )

    def _patch(self, c: _Call):
        body, kind = c.body, self.headers.get("Content-Type", "")
        if isinstance(body, list) or kind.startswith("application/json-patch"):
            change = lambda o: json_patch(o, body)  # noqa: E731
        else:
            change = lambda o: (lambda merged: (o.clear(), o.update(merged)))(merge_patch(o, body))  # noqa: E731
        expect = (body.get("metadata") or {}).get("resourceVersion") if isinstance(body, dict) else None
        return self._json(200, self.api.store.update(c.plural, c.ns, c.name, change, expect, client=True))

    # -- responses
    def _watch(self, plural, ns, query):
        timeout = float(query.get("timeoutSeconds") or DEFAULT_WATCH_TIMEOUT_S)
        events = self.api.store.watch(
            plural,
            ns,
            query.get("labelSelector"),
            query.get("fieldSelector"),
            query.get("resourceVersion"),
            timeout,
            query.get("allowWatchBookmarks") == "true",
        )
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for event in events:
                self._chunk(json.dumps(event).encode() + b"\n")
            self._chunk(b"")
        except (BrokenPipeError, ConnectionResetError):
            events.close()
        self.close_connection = True

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _json(self, code: int, obj) -> None:
        self._send(code, json.dumps(obj).encode(), "application/json")

    def _text(self, code: int, text: str) -> None:
        self._send(code, text.encode(), "text/plain")

    def _send(self, code: int, data: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


# (what a path names, method) -> the handler's verb; "collection": no name, "object": a name (its /status too)
_ROUTES = {
    ("collection", "POST"): _Handler._create,
    ("collection", "GET"): _Handler._list_or_watch,
    ("collection", "DELETE"): _Handler._delete_collection,
    ("log", "GET"): _Handler._log,
    ("eviction", "POST"): _Handler._evict,
    ("object", "GET"): _Handler._get,
    ("object", "DELETE"): _Handler._delete,
    ("object", "PUT"): _Handler._replace,
    ("object", "PATCH"): _Handler._patch,
}


def _handler(api: KubeAPI) -> type[_Handler]:
    """The request handler class of ``api``'s server."""
    return type("Handler", (_Handler,), {"api": api})


def point_at(api_client, host: str) -> None:
    """Send ``api_client``'s calls to ``host`` from now on. The kubeconfig's token auth installs a
    hook that copies the kubeconfig's server back into the configuration before every call
    (``kubernetes.config.kube_config._set_config``): it goes too, else the calls still reach the
    double's old port (CI: another test's server, started on it meanwhile, answered them)."""
    api_client.configuration.refresh_api_key_hook = None
    api_client.configuration.host = host
