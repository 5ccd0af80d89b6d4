"""The OpenAPI 3 schema of ``proteus serve`` (``GET /openapi.json``), built by hand from the endpoints'
contract (docs/predict.md) so that it lists every error answer, not only the successful ones."""

from __future__ import annotations

from typing import Any

from proteus._version import __version__

__all__ = ["openapi_schema"]

_ERROR = {"$ref": "#/components/schemas/Error"}


def _answer(
    description: str, schema: dict[str, Any] | None = None, headers: dict[str, Any] | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "description": description,
        "content": {"application/json": {"schema": schema or _ERROR}},
    }
    if headers:
        out["headers"] = headers
    return out


_ALLOW = {"Allow": {"description": "the methods this path answers", "schema": {"type": "string"}}}
_RETRY = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}
_COMMON = {
    "405": _answer("another method than the path answers (the `Allow` header lists them)", headers=_ALLOW),
    "500": _answer("an internal error (the message says nothing more; the server's log has the details)"),
    "501": _answer("a method that no endpoint answers"),
}
_PREDICT_ERRORS = {
    "400": _answer("an unreadable image (named), a bad `top_k`, an empty body or a body that ended early"),
    "408": _answer(
        "the body stayed silent for --read-timeout seconds, or did not arrive within "
        "--request-timeout; the connection is closed"
    ),
    "413": _answer(
        "a body over --max-body, more images than --max-images, more pixels (from the headers) than "
        "--max-request-pixels, an image over the per-image limit, or JSON nested too deeply; the message "
        "names the budget"
    ),
    "503": _answer(
        "too many requests at once (--max-concurrency served, --max-queue waiting), or the knowledge base "
        "cannot be used right now: retry",
        headers=_RETRY,
    ),
    "504": _answer("no answer within --request-timeout seconds (the server is busy)"),
}
_TOP_K = {
    "name": "top_k",
    "in": "query",
    "required": False,
    "description": "the k best classes of the retrieved task in each row's `top_k`",
    "schema": {"type": "integer", "minimum": 1, "default": 1},
}
_IMAGE_BODY = {
    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
    "image/*": {"schema": {"type": "string", "format": "binary"}},
    "multipart/form-data": {
        "schema": {"type": "object", "additionalProperties": {"type": "string", "format": "binary"}}
    },
}


def _schemas(max_images: int) -> dict[str, Any]:
    nullable_int = {"type": ["integer", "null"]}
    nullable_num = {"type": ["number", "null"]}
    row = {
        "type": "object",
        "description": "one input's prediction (docs/predict.md, the same as `proteus predict --json`)",
        "required": ["file", "class", "label", "task", "head_score", "p_all", "confidence", "top_k"],
        "properties": {
            "file": {"type": "string", "description": "the multipart file name, or `body`"},
            "class": {"type": ["string", "null"], "description": "null for an input from no learned task"},
            "nearest_class": {"type": "string", "description": "the learned class nearest the input"},
            "label": {"type": "integer"},
            "class_index": nullable_int,
            "task": nullable_int,
            "component": nullable_int,
            "signature_score": nullable_num,
            "head_score": {"type": "number"},
            "p_task": nullable_num,
            "p_all": {"type": "number"},
            "head_softmax": {"type": "number", "deprecated": True},
            "confidence": {
                "type": "number",
                "description": "the probability of the class among the learned classes: p_all calibrated by "
                "the temperature of the class's task (equal to p_all where the task has none)",
            },
            "temperature": {**nullable_num, "description": "that temperature; null where the task has none"},
            "calibrated": {"type": "boolean", "description": "whether the class's task has a temperature"},
            "known": {
                "type": ["boolean", "null"],
                "description": "false: from no learned task (class null); null: no detector",
            },
            "novelty": nullable_num,
            "top_k": {"type": "array", "items": {"type": "object"}},
        },
    }
    return {
        "Error": {
            "type": "object",
            "required": ["error"],
            "properties": {"error": {"type": "string", "description": "what went wrong and what to do"}},
        },
        "Row": row,
        "ErrorRow": {
            "type": "object",
            "required": ["file", "error"],
            "properties": {"file": {"type": "string"}, "error": {"type": "string"}},
        },
        "Predictions": {
            "type": "object",
            "required": ["kb_tasks", "predictions"],
            "properties": {
                "kb_tasks": {"type": "integer", "description": "the tasks of the state that answered"},
                "predictions": {"type": "array", "items": {"$ref": "#/components/schemas/Row"}},
            },
        },
        "BatchPredictions": {
            "type": "object",
            "required": ["kb_tasks", "predictions", "errors"],
            "properties": {
                "kb_tasks": {"type": "integer"},
                "errors": {"type": "integer", "description": "error rows"},
                "predictions": {
                    "type": "array",
                    "maxItems": max_images,
                    "items": {
                        "oneOf": [
                            {"$ref": "#/components/schemas/Row"},
                            {"$ref": "#/components/schemas/ErrorRow"},
                        ]
                    },
                },
            },
        },
        "JsonImages": {
            "type": "object",
            "required": ["images"],
            "properties": {
                "images": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": max_images,
                    "items": {
                        "type": "object",
                        "required": ["data"],
                        "properties": {
                            "name": {"type": "string"},
                            "data": {"type": "string", "format": "byte"},
                        },
                    },
                }
            },
        },
        "Health": {
            "type": "object",
            "required": ["status", "kb_tasks"],
            "properties": {
                "status": {"type": "string", "enum": ["ok", "stale"]},
                "kb": {"type": "string"},
                "kb_tasks": {"type": "integer"},
                "stale": {
                    "description": "null, or since when and why manifest.json on disk could not be loaded "
                    "(the last good state is served)",
                    "oneOf": [
                        {"type": "null"},
                        {
                            "type": "object",
                            "properties": {"since": {"type": "string"}, "reason": {"type": "string"}},
                        },
                    ],
                },
                "reloads": {"type": "integer"},
                "active": {"type": "integer"},
                "waiting": {"type": "integer"},
                "batches": {"type": "integer"},
                "images": {"type": "integer"},
                "largest_batch": {"type": "integer"},
            },
        },
        "Tasks": {
            "type": "object",
            "description": "`proteus kb info --json`; `root` is the directory's name",
            "required": ["root"],
            "properties": {"root": {"type": "string"}},
        },
    }


def openapi_schema(endpoints: dict[str, tuple[str, ...]], max_body: int, max_images: int) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``endpoints`` (path -> methods), whose operations are described here."""
    ref = lambda name: {"$ref": f"#/components/schemas/{name}"}  # noqa: E731
    ops: dict[str, dict[str, Any]] = {
        "/predict": {
            "post": {
                "summary": "predict one image (the body) or the files of a multipart body",
                "description": f"Every image must be readable (else 400 naming it). Body: 1 B .. "
                f"{max_body} B, at most {max_images} images.",
                "operationId": "predict",
                "parameters": [_TOP_K],
                "requestBody": {"required": True, "content": _IMAGE_BODY},
                "responses": {
                    "200": _answer("a row per image", ref("Predictions")),
                    **_PREDICT_ERRORS,
                    **_COMMON,
                },
            }
        },
        "/predict/batch": {
            "post": {
                "summary": "predict many images; an unreadable one gets an error row, the batch goes on",
                "description": 'A multipart body of files, or JSON `{"images": [{"name", "data": base64}]}`.',
                "operationId": "predictBatch",
                "parameters": [_TOP_K],
                "requestBody": {
                    "required": True,
                    "content": {
                        "multipart/form-data": _IMAGE_BODY["multipart/form-data"],
                        "application/json": {"schema": ref("JsonImages")},
                    },
                },
                "responses": {
                    "200": _answer("a row per part, in order", ref("BatchPredictions")),
                    **_PREDICT_ERRORS,
                    **_COMMON,
                },
            }
        },
        "/tasks": {
            "get": {
                "summary": "the knowledge base's tasks, classes and settings",
                "operationId": "tasks",
                "responses": {
                    "200": _answer("`proteus kb info --json` of the served state", ref("Tasks")),
                    "503": _answer("the knowledge base cannot be used right now: retry", headers=_RETRY),
                    **_COMMON,
                },
            }
        },
        "/health": {
            "get": {
                "summary": "liveness, the served state and the batching counters",
                "operationId": "health",
                "responses": {"200": _answer("serving", ref("Health")), **_COMMON},
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "this document",
                "operationId": "openapi",
                "responses": {
                    "200": {
                        "description": "the OpenAPI document",
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    },
                    **_COMMON,
                },
            }
        },
    }
    missing = set(endpoints) ^ set(ops)
    if missing:
        raise AssertionError(f"the OpenAPI operations and the endpoints differ: {sorted(missing)}")
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "proteus serve",
            "version": __version__,
            "description": "Predictions of a PROTEUS knowledge base (docs/predict.md).",
        },
        "paths": ops,
        "components": {"schemas": _schemas(max_images)},
    }
