# Empty: the first Python 3.11+ found (tests/setup/python.sh); `make test PYTHON=python3.13`.
PYTHON ?=
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# The real-vLLM suite's tiny model; vLLM's own environment is cached outside the repository.
TINY_LLAMA := loadtest/out/tiny-llama

.PHONY: test test-vllm image lint demo schema deploy-base metrics-reference bench-overhead bench-endpoints bench-routers bench-startup bench-vllm soak fuzz clean

$(STAMP): pyproject.toml
	python=$$(PYTHON='$(PYTHON)' tests/setup/python.sh) && tests/setup/venv.sh "$$python" $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

# tests/setup/tools.sh installs (or names) the programs the tests run for real: redis-server,
# prometheus, promtool, kubectl. $(BIN) leads PATH so a kubectl it put there is found.
test: $(STAMP)
	tests/setup/tools.sh $(VENV)
	$(BIN)/ruff check gateway tests tests_vllm loadtest deploy
	$(BIN)/ruff format --check gateway tests tests_vllm loadtest deploy
	$(BIN)/mypy gateway
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -q

# Real vLLM (CPU build) behind the gateway: builds the tiny model, installs vLLM once, runs
# tests_vllm/, whose session fixture starts vLLM on a free loopback port and always stops it.
test-vllm: $(STAMP)
	VLLM_PYTHON=$$(tests_vllm/vllm_env.sh) && \
	HF_HUB_OFFLINE=1 "$$VLLM_PYTHON" -m loadtest.tiny_llama $(TINY_LLAMA) && \
	VLLM_PYTHON=$$VLLM_PYTHON VLLM_MODEL_DIR=$(TINY_LLAMA) PATH="$(abspath $(BIN)):$$PATH" \
		$(BIN)/python -m pytest -q tests_vllm

# The Dockerfile built by buildah (daemonless, as root) on a Debian stand-in for its base, which
# CI cannot pull; the image then checks the chart's policy, and the air-gapped tokenizer image
# (deploy/tokenizers.Dockerfile) is built on it and copied from (.ci/image.sh says why and how).
image: $(STAMP)
	tests/setup/tools.sh $(VENV)
	.ci/image.sh $(VENV)

lint: $(STAMP)
	$(BIN)/ruff check --fix gateway tests tests_vllm loadtest deploy
	$(BIN)/ruff format gateway tests tests_vllm loadtest deploy
	$(BIN)/mypy gateway

# The policy's JSON Schema (for editors) and its field reference (docs), both from gateway/config/schema.py.
schema: $(STAMP)
	$(BIN)/llm-gateway schema > policies/schema.json
	$(BIN)/python -m gateway.config.reference > docs/policy-reference.md

# deploy/base, the kustomize tree, is the Helm chart rendered with its TPU values
# (deploy/render.py): after changing the chart, render it again; tests/deploy/test_deploy.py checks it.
deploy-base: $(STAMP)
	export PATH="$(abspath $(BIN)):$$PATH"; \
	{ command -v helm >/dev/null || $(BIN)/python tests/setup/install_kubectl.py $(BIN); } && \
	$(BIN)/python deploy/render.py

# Every metric family /metrics exports (docs), from the gateway's metrics registry.
metrics-reference: $(STAMP)
	$(BIN)/python -m gateway.exporter.reference > docs/metrics-reference.md

demo: $(STAMP)
	$(BIN)/python -m loadtest.demo

bench-overhead: $(STAMP)
	$(BIN)/python -m loadtest.bench_overhead

bench-endpoints: $(STAMP)
	$(BIN)/python -m loadtest.bench_endpoints

# The latency the gateway, the pass-through, nginx and vllm-router each add at one connection,
# side by side (a router not installed is skipped: `python -m loadtest.bench_routers --help`).
bench-routers: $(STAMP)
	$(BIN)/python -m loadtest.bench_routers $(BENCH_ROUTERS_ARGS)

# Ready-time and RSS of `serve` on the real Gemma 3 and Llama 3 tokenizers (one model, two, three
# naming one directory) and `explain`'s time; two checkouts side by side, by ratio, with
# BENCH_STARTUP_ARGS='--tree before=<worktree> --tree after=.'.
bench-startup: $(STAMP)
	$(BIN)/python -m loadtest.bench_startup $(BENCH_STARTUP_ARGS)

soak: $(STAMP)
	$(BIN)/python -m loadtest.soak

# The generative adversary's long profile (issue 35's promises): 10 minutes against one gateway,
# 10 against two sharing redis-server, then 10 against a pod of two workers sharing it; a fresh
# seed each, printed, and a report per run in loadtest/out/. Replay one:
# `python -m loadtest.adversary --seed N --seconds 600 [--gateways 2] [--workers 2]`.
FUZZ_SECONDS ?= 600
fuzz: $(STAMP)
	tests/setup/tools.sh $(VENV)
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m loadtest.adversary --seconds $(FUZZ_SECONDS) \
		--gateways 1 --out loadtest/out/fuzz-one-gateway.md; one=$$?; \
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m loadtest.adversary --seconds $(FUZZ_SECONDS) \
		--gateways 2 --out loadtest/out/fuzz-two-gateways.md; two=$$?; \
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m loadtest.adversary --seconds $(FUZZ_SECONDS) \
		--workers 2 --out loadtest/out/fuzz-pod.md; pod=$$?; \
	test $$one -eq 0 -a $$two -eq 0 -a $$pod -eq 0

bench-vllm: $(STAMP)
	VLLM_PYTHON=$$(tests_vllm/vllm_env.sh) && \
	HF_HUB_OFFLINE=1 "$$VLLM_PYTHON" -m loadtest.tiny_llama $(TINY_LLAMA) && \
	$(BIN)/python -m loadtest.bench_vllm --vllm-python "$$VLLM_PYTHON" --model-dir $(TINY_LLAMA)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
