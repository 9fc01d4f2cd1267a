# The two commands of the README: `make demo` and `make test`.
PYTHON ?= python3
export PYTHON

.PHONY: demo test generate docs

demo:
	scripts/setup.sh
	$(PYTHON) -m lossbeat demo $(ARGS)

test:
	scripts/setup.sh --servers
	$(PYTHON) -m pytest -q $(PYTEST_ARGS)

# Regenerate every checked-in generated file from the thresholds file: the one command
# that writes into the checkout (users write into a folder: lossbeat generate --output-dir DIR).
generate:
	$(PYTHON) -m lossbeat rules --checkout
	$(PYTHON) -m lossbeat dashboards --checkout
	$(PYTHON) -c "from lossbeat.metrics import update_readme; update_readme('README.md')"

# The evaluation tables of docs/analyze.md (false alarms and detection; trains the demo model).
docs:
	$(PYTHON) -m lossbeat.evaluation --write
