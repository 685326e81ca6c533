"""A generated suite of JSON Schemas, each with one instance that satisfies it (deterministic
by seed): strings (free, bounded, patterned, formatted), integers (free, bounded), numbers,
booleans, enums, nullable types, arrays (bounded lengths) and objects nested up to three deep
with required and optional properties."""
from __future__ import annotations

import random

WORDS = ["alpha", "beta", "gamma", "delta", "red", "green", "blue", "north", "south", "ok"]


def _leaf(rng: random.Random):
    kind = rng.choice(["string", "bounded_string", "pattern", "integer", "bounded_int",
                       "number", "boolean", "enum", "nullable", "const"])
    if kind == "string":
        return {"type": "string"}, rng.choice(WORDS)
    if kind == "bounded_string":
        lo = rng.randint(1, 3)
        hi = lo + rng.randint(2, 12)
        return {"type": "string", "minLength": lo, "maxLength": hi}, "x" * rng.randint(lo, hi)
    if kind == "pattern":
        return {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}, "AB-123"
    if kind == "integer":
        return {"type": "integer"}, rng.randint(-1000, 1000)
    if kind == "bounded_int":
        lo = rng.randint(-5, 5)
        hi = lo + rng.randint(1, 100)
        return {"type": "integer", "minimum": lo, "maximum": hi}, rng.randint(lo, hi)
    if kind == "number":
        return {"type": "number"}, round(rng.uniform(-100, 100), 2)
    if kind == "boolean":
        return {"type": "boolean"}, rng.random() < 0.5
    if kind == "enum":
        values = rng.sample(WORDS, rng.randint(2, 5))
        return {"enum": values}, rng.choice(values)
    if kind == "const":
        return {"const": "fixed"}, "fixed"
    return {"type": ["string", "null"]}, None


def _node(rng: random.Random, depth: int):
    r = rng.random()
    if depth <= 0 or r < 0.45:
        return _leaf(rng)
    if r < 0.7:
        item, instance = _node(rng, depth - 1)
        lo = rng.randint(0, 2)
        hi = lo + rng.randint(1, 3)
        return ({"type": "array", "items": item, "minItems": lo, "maxItems": hi},
                [instance] * max(lo, 1))
    return _object(rng, depth - 1)


def _object(rng: random.Random, depth: int):
    props, instance, required = {}, {}, []
    for i in range(rng.randint(1, 5)):
        name = f"{rng.choice(WORDS)}_{i}"
        schema, value = _node(rng, depth)
        props[name] = schema
        if rng.random() < 0.7:
            required.append(name)
            instance[name] = value
    return ({"type": "object", "properties": props, "required": required,
             "additionalProperties": False}, instance)


def generate(count: int = 60, seed: int = 0) -> list[tuple[dict, object]]:
    """`count` (schema, instance) pairs; the schemas are objects nested 1-3 deep."""
    rng = random.Random(seed)
    return [_object(rng, rng.randint(1, 3)) for _ in range(count)]
