"""What acts: models, prompts, chat templates and the policies built on them.

* :mod:`.models`: models that work offline (the tiny random Qwen2, SmolLM2-135M-Instruct,
  a Hub id from the local cache through :mod:`.hub`);
* :mod:`.prompts` and :mod:`.chat_format`: one ReAct prompt builder and action parser per
  env, rendered through the tokenizer's own chat template;
* :mod:`.policy`: :class:`~.policy.LLMPolicy` (a context in, an action with its tokens
  out) and :mod:`.scoring`: the scoring policy for tiny models.

Imports: the engine and the envs only (the bottom of ``branchgym.agents``).
"""
