# The two commands of the README. Both set up everything first (fast when cached).
.PHONY: setup run test

setup:
	bash scripts/setup.sh

run: setup
	.venv/bin/asyncrl run examples/arith.yaml --steps 5

# The tests also cover the optional Megatron-Core trainer backend.
test:
	bash scripts/setup.sh megatron
	bash scripts/test.sh
