"""The offline API's inputs, named and shaped as vLLM's (SamplingParams, BeamSearchParams), and
the GenerateRequest each becomes (pagoda/offline.py sends it, pagoda/outputs.py reads its
answer)."""
from __future__ import annotations

import json
from dataclasses import dataclass

from gateway.rest.openai_schema import seed_bits
from proto import pagoda_pb2 as pb


@dataclass
class StructuredOutputsParams:
    """vLLM's: exactly one of json (a schema, as a dict or JSON text), regex, choice, grammar
    (EBNF), json_object and structural_tag. JSON whitespace is not free unless
    disable_any_whitespace is False."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict | str | None = None
    disable_any_whitespace: bool = True

    def to_proto(self) -> pb.StructuredOutput:
        kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
                 if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError("StructuredOutputsParams needs exactly one of json, regex, choice, "
                             f"grammar, json_object and structural_tag, got {kinds}")
        out = pb.StructuredOutput(any_whitespace=not self.disable_any_whitespace)
        kind = kinds[0]
        value = getattr(self, kind)
        if kind == "json":
            out.json_schema = value if isinstance(value, str) else json.dumps(value)
        elif kind == "choice":
            out.choice.values.extend(value)
        elif kind == "json_object":
            out.json_object = True
        elif kind == "structural_tag":
            out.structural_tag = value if isinstance(value, str) else json.dumps(value)
        else:
            setattr(out, kind, value)
        return out


@dataclass
class SamplingParams:
    """vLLM's defaults: temperature 1, top_p 1, top_k 0 (off), max_tokens 16."""
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0
    structured_outputs: StructuredOutputsParams | None = None


@dataclass
class BeamSearchParams:
    """vLLM's, for LLM.beam_search, plus transformers' early_stopping ("true", "false", "never")."""
    beam_width: int
    max_tokens: int = 16
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: str = "false"
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    priority: int = 0


def generate_request(fields: dict, p: SamplingParams | BeamSearchParams) -> pb.GenerateRequest:
    if isinstance(p, BeamSearchParams):
        name = "BeamSearchParams"
        req = _message(pb.GenerateRequest, name, priority=p.priority, skip_special_tokens=p.skip_special_tokens,
                       return_prompt_token_ids=True)
        req.beam_search.CopyFrom(_message(pb.BeamSearchParams, name, beam_width=p.beam_width,
                                          length_penalty=p.length_penalty, early_stopping=p.early_stopping))
        req.stopping.CopyFrom(_message(pb.StoppingCriteria, name, max_tokens=p.max_tokens, ignore_eos=p.ignore_eos,
                                       stop_token_ids=p.stop_token_ids or []))
        return _with_prompt(req, fields)
    name = "SamplingParams"
    s = _message(pb.SamplingParams, name, n=p.n, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                 min_p=p.min_p, presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                 repetition_penalty=p.repetition_penalty, logit_bias=p.logit_bias or {},
                 seed=None if p.seed is None else seed_bits(p.seed),
                 logprobs=p.logprobs, prompt_logprobs=p.prompt_logprobs)
    if p.structured_outputs is not None:
        s.structured_output.CopyFrom(p.structured_outputs.to_proto())
    stop = [p.stop] if isinstance(p.stop, str) else list(p.stop or [])
    stopping = _message(pb.StoppingCriteria, name, stop=stop, stop_token_ids=p.stop_token_ids or [],
                        ignore_eos=p.ignore_eos, min_tokens=p.min_tokens, max_tokens=p.max_tokens,
                        include_stop_str_in_output=p.include_stop_str_in_output)
    req = _message(pb.GenerateRequest, name, priority=p.priority, skip_special_tokens=p.skip_special_tokens,
                   return_prompt_token_ids=True, truncate_prompt_tokens=p.truncate_prompt_tokens)
    req.sampling.CopyFrom(s)
    req.stopping.CopyFrom(stopping)
    return _with_prompt(req, fields)


def _message(cls, owner: str, **fields):
    """cls(**fields) without the None ones; where protobuf refuses a value (a number past its
    field's range, a wrong type), a ValueError naming the field ("SamplingParams.top_k: Value out
    of range: 1099511627776"), found by building the fields one at a time only then."""
    fields = {k: v for k, v in fields.items() if v is not None}
    try:
        return cls(**fields)
    except (ValueError, TypeError):
        for field, value in fields.items():
            try:
                cls(**{field: value})
            except (ValueError, TypeError) as e:
                raise ValueError(f"{owner}.{field}: {e}") from None
        raise


def _with_prompt(req: pb.GenerateRequest, fields: dict) -> pb.GenerateRequest:
    for name, value in fields.items():
        try:
            if name == "messages":
                for m in value:
                    req.messages.add(role=m["role"], content=m["content"])
            elif name == "prompt_token_ids":
                req.prompt_token_ids.extend(value)
            else:  # prompt, cache_salt
                setattr(req, name, value)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{name}: {e}") from None
    return req


def prompt_fields(prompt) -> dict:
    """One prompt as vLLM's LLM.generate takes it: text, token ids, or a TextPrompt /
    TokensPrompt dict ({"prompt": text} or {"prompt_token_ids": ids}, either with "cache_salt")."""
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, dict):
        kinds = [k for k in ("prompt", "prompt_token_ids") if k in prompt]
        other = sorted(set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"})
        if len(kinds) != 1 or other:
            raise ValueError('a prompt dict holds "prompt" (text) or "prompt_token_ids", and maybe '
                             f'"cache_salt"; got {sorted(prompt)}')
        out = {kinds[0]: prompt[kinds[0]] if kinds[0] == "prompt" else list(prompt[kinds[0]])}
        if "cache_salt" in prompt:
            out["cache_salt"] = prompt["cache_salt"]
        return out
    return {"prompt_token_ids": list(prompt)}


def one_prompt(prompts) -> bool:
    """Whether generate's argument is a single prompt rather than a list of them."""
    return isinstance(prompts, (str, dict)) or bool(prompts) and isinstance(prompts[0], int)
