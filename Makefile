# The two commands of the README. Both set up everything first (fast when cached).
.PHONY: setup run test

# The experiment trackers' optional groups come with it (asyncrl.trainer.tracking).
TRACKING := wandb mlflow tensorboard

setup:
	bash scripts/setup.sh $(TRACKING)

run: setup
	.venv/bin/asyncrl run examples/arith.yaml --steps 5

# The tests also cover the optional Megatron-Core trainer backend.
test:
	bash scripts/setup.sh megatron $(TRACKING)
	bash scripts/test.sh
