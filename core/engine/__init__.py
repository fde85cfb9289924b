"""The torch inference engine, run by the rollout service and by the trainer's evaluator."""
