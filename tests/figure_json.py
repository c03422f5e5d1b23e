"""Reading a Plotly figure's JSON as the browser gets it (typed arrays are base64 `bdata`)."""

from __future__ import annotations

import base64
import json

import numpy as np


def values(array) -> np.ndarray:
    """A trace's x or y: a plain list, or plotly's {"dtype", "bdata"[, "shape"]} typed array."""
    if isinstance(array, dict) and "bdata" in array:
        out = np.frombuffer(base64.b64decode(array["bdata"]), dtype=np.dtype(array["dtype"]).newbyteorder("<"))
        return out.reshape([int(d) for d in str(array["shape"]).split(",")]) if "shape" in array else out
    return np.asarray(array if array is not None else [])


def spec(figure_or_json) -> dict:
    """The JSON spec of a go.Figure, a JSON string (an AppTest plotly element's proto.spec), or a dict."""
    if isinstance(figure_or_json, str):
        return json.loads(figure_or_json)
    if isinstance(figure_or_json, dict):
        return figure_or_json
    return json.loads(figure_or_json.to_json())


def points_by_trace(figure_or_json) -> dict[str, int]:
    """Trace name -> number of x values."""
    return {trace.get("name", ""): len(values(trace.get("x"))) for trace in spec(figure_or_json)["data"]}
