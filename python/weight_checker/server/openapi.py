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
#: A baseline where the action does not need one: absent, null, or a digest map.
_OPTIONAL_MAP: dict[str, Any] = {"anyOf": [_DIGEST_MAP, {"type": "null"}]}
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
                            # A baseline is checked whatever the action (as vLLM's model checks it).
                            "properties": {"action": {"const": "checksum"}, "baseline": _OPTIONAL_MAP},
                            "required": ["action"],
                        },
                        {
                            "title": "reset",
                            "type": "object",
                            "properties": {"action": {"const": "reset"}, "baseline": _OPTIONAL_MAP},
                            "required": ["action"],
                        },
                        {
                            "title": "compare",
                            "type": "object",
                            "properties": {"action": {"const": "compare"}, "baseline": _DIGEST_MAP},
                            "required": ["action", "baseline"],
                        },
                        {
                            "title": "block_digests",
                            "description": "this package's action (not vLLM's): each named tensor hashed in blocks",
                            "type": "object",
                            "properties": {
                                "action": {"const": "block_digests"},
                                "baseline": _OPTIONAL_MAP,
                                "keys": {
                                    "type": "array",
                                    "items": {"type": "string", "minLength": 1},
                                    "minItems": 1,
                                    "maxItems": 64,
                                    "uniqueItems": True,
                                },
                                "block_bytes": {"type": "integer", "minimum": 1},
                                "chain": {
                                    "description": "for the keys it names, SHA-256 chain states to continue over "
                                    "those blocks (answered as 'states' and 'zeros' instead of 'digests')",
                                    "type": "object",
                                    "additionalProperties": {
                                        "type": "array",
                                        "minItems": 1,
                                        "items": {
                                            "type": "array",
                                            "prefixItems": [
                                                {"type": "integer", "minimum": 0},
                                                {"type": "string", "maxLength": 218},
                                            ],
                                            "minItems": 2,
                                            "maxItems": 2,
                                        },
                                    },
                                },
                            },
                            "required": ["action", "keys", "block_bytes"],
                        },
                    ]
                }
            }
        },
    },
    "responses": {
        "200": {
            "description": "checksum: {checksums}; reset: {status}; compare: {match, mismatches}; "
            "block_digests: {block_digests}",
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
                                    "block_digests": {
                                        "type": "object",
                                        "additionalProperties": {
                                            "type": "object",
                                            "properties": {
                                                "digests": {"type": "array", "items": {"type": "string"}},
                                                "block_bytes": {"type": "integer"},
                                                "nbytes": {"type": "integer"},
                                                "shape": {"type": "array", "items": {"type": "integer"}},
                                                "dtype": {"type": "string"},
                                            },
                                        },
                                    }
                                },
                                "required": ["block_digests"],
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
