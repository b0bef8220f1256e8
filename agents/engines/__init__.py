"""Generation engines (imported lazily: each needs an extra).

* :mod:`branchgym.agents.engines.hf`: :class:`HFEngine` on transformers (``llm`` extra).
* :mod:`branchgym.agents.engines.vllm`: :class:`VLLMEngine` on vLLM (its own venv here).

Both offer ``generate(prompts, n, prefixes=..., seed=...) -> [[Generation]]`` and
``score(prompt, completions)``, and both expose ``tokenizer``, ``encode`` and
``decode``, which is all :class:`branchgym.agents.policies.policy.LLMPolicy` needs.

Imports: the engine and :mod:`branchgym.agents.policies` (models, the policy protocol).
"""
