"""Running a compile's graphs in onnxruntime: a session per file, a graph as its partitions in
manifest order, and one error type for a graph that does not run (a verification failure)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mtkc.errors import InputError, MismatchError
from mtkc.ir.execute import open_session, session, session_options
from mtkc.ir.outdir import check_graph_file
from mtkc.runtime.sessions import NO_PREPACKING, Sessions


def load_session(path: Path):
    """An ORT CPU session for an ONNX file, external data resolved beside it.

    From the path when onnxruntime takes it as is (it maps external data, no copy in Python); a
    model whose external data it refuses (a Hugging Face cache layout) goes through `session`."""
    proto = check_graph_file(path)  # external data inside its folder and within the files
    options = session_options()
    options.add_session_config_entry(NO_PREPACKING, "1")  # a prepacked copy would double the weights
    try:
        return open_session(str(path), options, str(path))
    except Exception:  # onnxruntime's own error types; the proto route below names the problem
        pass
    return session(proto, path.parent)


def run_partitions(out: Path, graph: dict, feeds: dict[str, np.ndarray], sessions: Sessions | None = None) -> dict[str, np.ndarray]:
    """Run the partitions in manifest order, each fed by name from the graph inputs and earlier partitions."""
    sessions = Sessions(out, optimize=False) if sessions is None else sessions
    env = dict(feeds)
    for part in graph["partitions"]:
        missing = [i["name"] for i in part["inputs"] if i["name"] not in env]
        if missing:
            raise InputError(f"manifest: partition {graph['name']}/{part['id']} input '{missing[0]}' is made by no earlier partition")
        path = Path(out) / part["path"]
        if not path.is_file():
            raise InputError(f"{path}: partition {graph['name']}/{part['id']} listed in the manifest is missing")
        session = guarded(lambda: sessions.get(path), f"partition {graph['name']}/{part['id']}")
        names = [o["name"] for o in part["outputs"]]
        feeds_ = {i["name"]: env[i["name"]] for i in part["inputs"]}
        env.update(zip(names, guarded(lambda: session.run(names, feeds_), f"partition {graph['name']}/{part['id']}")))
    missing = [o["name"] for o in graph["outputs"] if o["name"] not in env]
    if missing:
        raise InputError(f"{Path(out) / 'manifest.json'}: graph {graph['name']} output '{missing[0]}' is made by none of its "
                         f"{len(graph['partitions'])} partition(s)")
    return {o["name"]: env[o["name"]] for o in graph["outputs"]}


def run_session(sess, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [o.name for o in sess.get_outputs()]
    wanted = {i.name for i in sess.get_inputs()}
    return dict(zip(names, sess.run(names, {k: v for k, v in feeds.items() if k in wanted})))


def guarded(call, what: str):
    """Run one onnxruntime call; a runtime failure is a verification failure naming `what`."""
    try:
        return call()
    except (MismatchError, InputError):
        raise
    except Exception as exc:  # onnxruntime raises its own Fail/InvalidArgument/RuntimeException types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise MismatchError(f"verify: {what} does not run in onnxruntime: {first[:300]}") from None
