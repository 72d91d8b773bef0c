"""Macaron's Mixture-of-LoRA protocol in the local runtime, one job per module.

- `profile`: a model's routing profile (route instruction, expert descriptions, identity and
  summary instructions, default label), loaded from files.
- `route`: the route hop on L0 (the raw request plus the route instruction, a `model_id=`
  prefill, greedy and constrained to the labels), and the keyword fallback mode.
- `views`: each expert's own append-only view of the conversation.
- `summary`: the hidden summary hop that closes a task.
- `features`: what differs per model family (reasoning blocks, tool-call markup).
- `options`: a model's protocol settings from its manifest (`summaries`, profile, family).
"""
