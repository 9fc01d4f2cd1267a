# The two commands of the README: `make demo` and `make test`.
PYTHON ?= python3
export PYTHON

.PHONY: demo test test-prometheus3 test-report lint generate docs screenshots

demo:
	scripts/setup.sh
	$(PYTHON) -m lossbeat demo $(ARGS)

# Four test processes (pytest-xdist): most of the suite's time is spent waiting on servers
# and alert windows, not computing, so even two cores run four at once; TEST_WORKERS=0 runs
# them in this process. Bytecode is written (ignored __pycache__ folders): a machine that turns it
# off globally would compile lossbeat and rewrite the tests' asserts in every process the suite starts.
TEST_WORKERS ?= 4

test:
	scripts/setup.sh --servers
	env -u PYTHONDONTWRITEBYTECODE $(PYTHON) -m pytest -q -n $(TEST_WORKERS) --durations=10 $(PYTEST_ARGS)

# The tests that run a real Prometheus, Alertmanager, promtool or amtool (marker `servers`), again on
# the Prometheus 3 LTS line and a current Alertmanager (Debian unstable's packages, unpacked into a
# folder by scripts/prometheus3.sh; `make test` runs them on the system's, Debian stable's).
test-prometheus3:
	scripts/setup.sh --servers
	PATH="$$(scripts/prometheus3.sh):$$PATH" LOSSBEAT_EXPECT_PROMETHEUS=3 env -u PYTHONDONTWRITEBYTECODE \
	  $(PYTHON) -m pytest -q -n $(TEST_WORKERS) -m servers $(PYTEST_ARGS)

# ruff (lint and format) and mypy, configured in pyproject.toml; the lint extra installs them.
lint:
	$(PYTHON) -m pip install -q -e ".[lint]"
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m mypy

# docs/tests.md's measured part: both runs above, with JUnit files, then the page written from them.
# A failing run still writes its counts; the target then fails.
server_versions = Prometheus $$($(1)prometheus --version 2>&1 | awk 'NR==1{print $$3}'), Alertmanager $$($(1)amtool --version 2>&1 | awk 'NR==1{print $$3}')
test-report:
	-$(MAKE) test PYTEST_ARGS="--junitxml=out/junit.xml $(PYTEST_ARGS)"
	-$(MAKE) test-prometheus3 PYTEST_ARGS="--junitxml=out/junit-prometheus3.xml $(PYTEST_ARGS)"
	$(PYTHON) scripts/test_report.py --write docs/tests.md \
	  "$(call server_versions,)=out/junit.xml" \
	  "$(call server_versions,$$(scripts/prometheus3.sh)/)=out/junit-prometheus3.xml"

# Regenerate every checked-in generated file from the thresholds file: the one command
# that writes into the checkout (users write into a folder: lossbeat generate --output-dir DIR).
generate:
	$(PYTHON) -m lossbeat rules --checkout
	$(PYTHON) -m lossbeat dashboards --checkout
	$(PYTHON) -c "from lossbeat.exposition.metrics import update_reference_doc; update_reference_doc('docs/metrics.md')"
	$(PYTHON) -c "from lossbeat.cli import reference_markdown; open('docs/cli.md', 'w').write(reference_markdown())"

# The evaluation tables of docs/analyze.md (false alarms and detection; trains the demo model).
docs:
	$(PYTHON) -m lossbeat.analyze.evaluation --write

# The status page's screenshots in docs/img/ (a healthy run and each demo fault; headless chromium).
screenshots:
	$(PYTHON) scripts/status_screenshots.py $(ARGS)
