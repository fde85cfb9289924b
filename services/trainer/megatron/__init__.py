"""The Megatron-Core trainer backend (`trainer.backend: megatron`): the job's Llama-family
policy as a Megatron-Core GPTModel (compat: the CPU shims; weights: Hugging Face <-> Megatron
names; policy: building it and its per-token log-probs). Needs the optional dependency group
`megatron` (`pip install 'asyncrl[megatron]'`)."""
