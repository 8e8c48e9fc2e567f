# kvwarm: `make serve` and `make test` work on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
# empty: kvwarm's own settings (.env, KVWARM_HOST/KVWARM_PORT, else 127.0.0.1:8080).
# Only `make serve HOST=... PORT=...` sets them: tcsh exports HOST (the machine's
# name) and many platforms PORT, which bound a LAN address with no API key
ifneq ($(origin HOST),command line)
HOST :=
endif
ifneq ($(origin PORT),command line)
PORT :=
endif

UNAME := $(shell uname -s)
# the MLX build installed last (.installed-cpu / -cuda / -default): a later plain
# `make serve` keeps it, `make install MLX_EXTRA=...` switches
# (only those names: an older Makefile's .installed-dev is no MLX build)
INSTALLED := $(patsubst .installed-%,%,$(notdir $(firstword $(wildcard \
  $(VENV)/.installed-cpu $(VENV)/.installed-cuda $(VENV)/.installed-default))))
ifneq ($(INSTALLED),)
MLX_EXTRA ?= $(subst default,,$(INSTALLED))
else ifeq ($(UNAME),Linux)
MLX_EXTRA ?= cpu        # override with MLX_EXTRA=cuda on NVIDIA machines
else
MLX_EXTRA ?=
endif
MLX_EXTRA := $(strip $(MLX_EXTRA))
# the stamp names the MLX build installed: `make install MLX_EXTRA=cuda` after a CPU
# install reinstalls (one stamp for all said "Nothing to be done")
STAMP := $(VENV)/.installed-$(or $(MLX_EXTRA),default)
OPENBLAS := /usr/lib/$(shell uname -m)-linux-gnu/openblas-pthread/libblas.so.3

.PHONY: install install-dev system-deps test-tools serve test test-fast bench bench-agents bench-dialects lint clean help

help:
	@echo "make serve   install, prepare the default model, serve (HOST=, PORT= override .env)"
	@echo "make test    install dev tools and run the whole suite"
	@echo "make bench   throughput/TTFT benchmark vs mlx_lm.server"
	@echo "make bench-agents  prompt-cache reuse on simulated agent traffic vs mlx_lm.server"
	@echo "make bench-dialects  one agent conversation via chat, Messages and Responses: reuse per dialect"
	@echo "make install create $(VENV) and install kvwarm (idempotent)"

# OpenBLAS makes MLX's Linux CPU backend ~50x faster at matmul (see DESIGN.md);
# ffmpeg reads video_url parts' frames for vision models; Debian and Ubuntu ship
# `python3 -m venv` apart (python3.X-venv), without which the venv has no pip.
system-deps:
	@if [ "$(UNAME)" = Linux ] && ! $(PYTHON) -c "import ensurepip" 2>/dev/null && command -v apt-get >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO=skip; fi; \
	  VENV_PKG=$$($(PYTHON) -c 'import sys; print("python%d.%d-venv" % sys.version_info[:2])'); \
	  if [ "$$SUDO" = skip ]; then \
	    echo "note: not root; install $$VENV_PKG so that $(PYTHON) -m venv works"; \
	  else \
	    echo "installing $$VENV_PKG ($(PYTHON) -m venv)"; \
	    $$SUDO apt-get install -y -q $$VENV_PKG >/dev/null 2>&1 || \
	    { $$SUDO apt-get update -q >/dev/null 2>&1 && $$SUDO apt-get install -y -q $$VENV_PKG >/dev/null; } || \
	    echo "warning: could not install $$VENV_PKG; the virtual environment may have no pip"; \
	  fi; \
	fi
	@if [ "$(UNAME)" = Linux ] && [ ! -e "$(OPENBLAS)" ] && command -v apt-get >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO=skip; fi; \
	  if [ "$$SUDO" = skip ]; then \
	    echo "note: not root; install libopenblas0-pthread for fast CPU inference"; \
	  else \
	    echo "installing libopenblas0-pthread (fast BLAS for MLX on CPU)"; \
	    $$SUDO apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1 || \
	    { $$SUDO apt-get update -q >/dev/null 2>&1 && $$SUDO apt-get install -y -q libopenblas0-pthread >/dev/null; } || \
	    echo "warning: could not install libopenblas0-pthread; MLX will use its slow reference BLAS"; \
	  fi; \
	fi
	@if [ "$(UNAME)" = Linux ] && ! command -v ffmpeg >/dev/null && command -v apt-get >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO=skip; fi; \
	  if [ "$$SUDO" = skip ]; then \
	    echo "note: not root; install ffmpeg for video_url parts (vision models)"; \
	  else \
	    echo "installing ffmpeg (video frames for vision models)"; \
	    $$SUDO apt-get install -y -q --no-install-recommends ffmpeg >/dev/null 2>&1 || \
	    { $$SUDO apt-get update -q >/dev/null 2>&1 && $$SUDO apt-get install -y -q --no-install-recommends ffmpeg >/dev/null; } || \
	    echo "warning: could not install ffmpeg; video_url parts will be refused (400)"; \
	  fi; \
	fi
	@if [ "$(UNAME)" = Darwin ] && ! command -v ffmpeg >/dev/null; then \
	  echo "note: brew install ffmpeg for video_url parts (vision models)"; \
	fi

# Real peers the monitoring tests run against: Prometheus (Debian package) and the
# LiteLLM proxy (its own venv: its pins must not bend kvwarm's).
LITELLM_VENV ?= .venv-litellm
# the release the LiteLLM test was last proven with: unpinned, a new one could
# break CI on a clean machine overnight (make LITELLM_SPEC=litellm[proxy] for the newest)
LITELLM_SPEC ?= litellm[proxy]==1.108.7
test-tools:
	@if ! command -v prometheus >/dev/null && command -v apt-get >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO=skip; fi; \
	  if [ "$$SUDO" = skip ]; then echo "note: not root; the Prometheus test needs the prometheus package"; \
	  else echo "installing prometheus (monitoring tests)"; \
	    $$SUDO apt-get install -y -q prometheus >/dev/null 2>&1 || \
	    { $$SUDO apt-get update -q >/dev/null 2>&1 && $$SUDO apt-get install -y -q prometheus >/dev/null; } || \
	    echo "warning: could not install prometheus"; \
	  fi; \
	fi
	@test -x $(LITELLM_VENV)/bin/litellm || { echo "installing $(LITELLM_SPEC) into $(LITELLM_VENV) (LiteLLM test)"; \
	  $(PYTHON) -m venv $(LITELLM_VENV) && $(LITELLM_VENV)/bin/pip install -q --disable-pip-version-check '$(LITELLM_SPEC)' || \
	  echo "warning: could not install litellm[proxy]; the LiteLLM test will not run"; }

$(STAMP): pyproject.toml deploy/pip_requirements.py Makefile
	@$(MAKE) --no-print-directory system-deps
	@# a venv without pip (python3-venv missing the first time) is made again
	$(PY) -m pip --version >/dev/null 2>&1 || $(PYTHON) -m venv $(VENV)
	rm -f $(VENV)/.installed-*
	$(PIP) install -q --upgrade pip setuptools
	$(PIP) install -q --no-deps -e .
	$(PY) deploy/pip_requirements.py $(MLX_EXTRA) vision > $(VENV)/requirements.txt
	$(PIP) install -q -r $(VENV)/requirements.txt
	$(PIP) install -q --no-deps $$($(PY) deploy/pip_requirements.py --no-deps-only vision)
	touch $@

$(VENV)/.dev-installed: $(STAMP)
	$(PY) deploy/pip_requirements.py $(MLX_EXTRA) dev > $(VENV)/requirements-dev.txt
	$(PIP) install -q -r $(VENV)/requirements-dev.txt
	touch $@

install: $(STAMP)

install-dev: $(VENV)/.dev-installed

serve: install
	$(VENV)/bin/kvwarm prepare
	$(VENV)/bin/kvwarm serve $(if $(HOST),--host $(HOST)) $(if $(PORT),--port $(PORT))

test: install-dev test-tools
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest

test-fast: install-dev
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest -m "not e2e"

bench: install-dev
	$(PY) bench/bench_serving.py

bench-agents: install-dev
	$(PY) bench/bench_agents.py

bench-dialects: install-dev
	$(PY) bench/bench_dialects.py

lint: install-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
