"""How an engine or trainer process is started: SGLang's server arguments, torchrun's options."""
