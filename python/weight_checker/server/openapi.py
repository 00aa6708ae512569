"""The route's OpenAPI description (request and response schemas)."""

from __future__ import annotations

from typing import Any

# vLLM compares digest strings as they are (a wrong one is a mismatch, not a
# bad request), so the schema asks for strings and nothing more.
_DIGEST_MAP: dict[str, Any] = {
    "type": "object",
    "additionalProperties": {"type": "string"},
}
_ERROR: dict[str, Any] = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "integer"},
            },
            "required": ["message", "type", "code"],
        }
    },
}
OPENAPI: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "oneOf": [
                        {
                            "title": "checksum",
                            "type": "object",
                            "properties": {"action": {"const": "checksum"}},
                            "required": ["action"],
                        },
                        {
                            "title": "reset",
                            "type": "object",
                            "properties": {"action": {"const": "reset"}},
                            "required": ["action"],
                        },
                        {
                            "title": "compare",
                            "type": "object",
                            "properties": {"action": {"const": "compare"}, "baseline": _DIGEST_MAP},
                            "required": ["action", "baseline"],
                        },
                    ]
                }
            }
        },
    },
    "responses": {
        "200": {
            "description": "checksum: {checksums}; reset: {status}; compare: {match, mismatches}",
            "content": {
                "application/json": {
                    "schema": {
                        "oneOf": [
                            {
                                "type": "object",
                                "properties": {"checksums": _DIGEST_MAP},
                                "required": ["checksums"],
                            },
                            {
                                "type": "object",
                                "properties": {"status": {"const": "reset"}},
                                "required": ["status"],
                            },
                            {
                                "type": "object",
                                "properties": {
                                    "match": {"type": "boolean"},
                                    "mismatches": {"type": "array", "items": {"type": "string"}},
                                },
                                "required": ["match", "mismatches"],
                            },
                        ]
                    }
                }
            },
        },
        "400": {
            "description": "Invalid request",
            "content": {"application/json": {"schema": _ERROR}},
        },
        "500": {
            "description": "Two workers produced the same key",
            "content": {"application/json": {"schema": _ERROR}},
        },
    },
}
