# The two commands in the README: `make demo` and `make test`.
.PHONY: setup demo test lint

setup:
	@bash scripts/setup.sh

demo: setup
	.venv/bin/python -m recipes.demo

lint: setup
	.venv/bin/ruff check .

test: setup
	bash scripts/test.sh
