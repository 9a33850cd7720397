# Two entry points: `make demo` (set up + main job) and `make test` (set up + full test suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.eva0-edge-installed

FMNIST := /usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz

.PHONY: blackbox setup dashboard-assets monitoring-tools data demo perf-analyzer test test-fast lint mutate tables tables-bn tune-bnstats sweep hostile budget pareto layers quant tune FORCE

# A strict editable install: a link tree mirrors the import names (eva0_edge.runtime ->
# runtime/, ...), so static tools (mypy, IDEs) resolve them too; the tree is rebuilt when the
# set of modules changes (SOURCES below), an edit to a module needs nothing.
SOURCES := $(sort $(wildcard src/eva0_edge/*.py exporter/*.py exporter/*/*.py runtime/*.py runtime/*/*.py quant/*.py \
	bench/*.py bench/testbed/*.py fleet/*.py))
SOURCE_LIST := $(VENV)/.eva0-edge-sources

$(SOURCE_LIST): FORCE
	@mkdir -p $(VENV)
	@echo "$(SOURCES)" | cmp -s - $@ || echo "$(SOURCES)" > $@

# The dashboard's chart library (uPlot) from the npm registry, as dashboard/package-lock.json
# pins it, copied into the package (runtime/server/static/, not in git) before the install
# packs it: the server needs no build step and nothing from outside at run time.
DASHBOARD_STATIC := runtime/server/static
DASHBOARD_STAMP := $(DASHBOARD_STATIC)/.copied
UPLOT_DIST := dashboard/node_modules/uplot/dist

$(DASHBOARD_STAMP): dashboard/package.json dashboard/package-lock.json
	npm ci --prefix dashboard --no-audit --no-fund --ignore-scripts
	mkdir -p $(DASHBOARD_STATIC)
	cp $(UPLOT_DIST)/uPlot.iife.min.js $(UPLOT_DIST)/uPlot.min.css $(DASHBOARD_STATIC)/
	cp dashboard/node_modules/uplot/LICENSE $(DASHBOARD_STATIC)/uPlot.LICENSE
	touch $@

dashboard-assets: $(DASHBOARD_STAMP)

$(STAMP): pyproject.toml constraints.txt $(SOURCE_LIST) $(DASHBOARD_STAMP)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,bench]" \
		--config-settings editable_mode=strict
	touch $@

FORCE:

setup: $(STAMP)

# Fashion-MNIST from Debian (MIT); needs root for apt-get.
data: $(FMNIST)

$(FMNIST):
	apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist

# The main job: a short continual stream (15 corruptions in a row, severity 5, 1000 test
# images each) on the shipped ResNet-GN, NoAdapt against EVA-0.
demo: setup data
	$(VENV)/bin/eva0-edge eval --model models/resnet_gn_fmnist.onnx --protocol continual \
		--severity 5 --limit 1000 --methods noadapt,eva0 --out out/demo

test: setup data perf-analyzer monitoring-tools
	$(PY) -m pytest -q -ra

# Debian's headless Chromium and its driver (the dashboard's browser test,
# tests/integration/test_dashboard.py, Selenium) and Prometheus with promtool (the alert rules'
# tests, tests/integration/test_alert_rules.py, test_prometheus.py); needs root for apt-get.
MONITORING_TOOLS := /usr/bin/chromedriver /usr/bin/prometheus /usr/bin/promtool

monitoring-tools:
	@missing=; for tool in $(MONITORING_TOOLS); do test -x $$tool || missing=1; done; \
	if [ -n "$$missing" ]; then \
		apt-get update -qq && apt-get install -y -qq chromium chromium-driver prometheus; fi

# Triton's perf_analyzer into .cache/perf-analyzer (tools/perf_analyzer.sh: on glibc < 2.38
# through Debian 13's loader and libraries, nothing installed system-wide)
perf-analyzer:
	bash tools/perf_analyzer.sh .cache/perf-analyzer

# The unit and component tiers (tests/unit, tests/component): no timm export, no server process,
# no dataset.
test-fast: setup
	$(PY) -m pytest -q -ra -m "not slow and not integration"

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy -p eva0_edge.runtime

# Mutation testing of the core numeric modules with mutmut (not in CI: too slow); writes
# tools/mutation-report.md (kill rate per module, every survivor with its diff).
mutate: setup
	$(PY) -m pip install -q -c constraints.txt -e ".[mutate]" --config-settings editable_mode=strict
	$(PY) tools/mutate.py

# The closing-note tables: both shipped models, severity 5, all methods, single + continual.
TABLE_METHODS := noadapt,eva0,eva0-dagger,zoa,spsa2-shared,tent,sar,deyo
TABLE_LIMIT ?= 1000
tables: setup data
	for m in vit_fmnist resnet_gn_fmnist; do for p in single continual; do \
		$(VENV)/bin/eva0-edge eval --model models/$$m.onnx --protocol $$p --severity 5 \
			--methods $(TABLE_METHODS) --limit $(TABLE_LIMIT) --out out/tables/$$m-$$p -q; \
	done; done

# The shipped BatchNorm model's table: its peers and the one-forward BatchNorm-statistics
# baselines, at the batch sizes the product serves (results/batchnorm/).
BN_TABLE_METHODS := noadapt,noadapt-shift,eva0,zoa,tent,bn-adapt,bn-ema
BN_TABLE_LIMIT ?= 500
tables-bn: setup data
	for p in single continual; do \
		$(VENV)/bin/eva0-edge eval --model models/mobilenet_bn_fmnist.onnx --protocol $$p \
			--severity 5 --methods $(BN_TABLE_METHODS) --limit $(BN_TABLE_LIMIT) --batch-sizes 1,16,64 \
			--threads 1 --out results/batchnorm/$$p -q; \
	done
	$(VENV)/bin/eva0-edge eval --model models/mobilenet_bn_fmnist.onnx --corruptions clean \
		--limit 2000 --batch-sizes 1,4,16,64 --methods noadapt,eva0,bn-adapt,bn-ema --threads 1 \
		--out results/batchnorm/clean -q

# The black-box study (the paper's Table 6) on the shipped ViT's prompt variant.
blackbox: setup data
	$(VENV)/bin/python -m eva0_edge.bench.blackbox --model models/vit_fmnist.onnx \
		--limit $(TABLE_LIMIT) --out out/blackbox

# Does adaptation hurt at any batch size? Clean (2000 test images, B = 1..64) and severity 5
# (single + continual, B = 1, 4, 16, 64) for both shipped models, one report each.
SWEEP_METHODS ?= noadapt,eva0
sweep: setup data
	for m in vit_fmnist resnet_gn_fmnist; do \
		$(VENV)/bin/eva0-edge eval --model models/$$m.onnx --corruptions clean --limit 2000 \
			--batch-sizes 1,2,4,8,16,32,64 --methods $(SWEEP_METHODS) --threads 1 \
			--out out/sweep/$$m-clean -q; \
		for p in single continual; do \
			$(VENV)/bin/eva0-edge eval --model models/$$m.onnx --protocol $$p --severity 5 \
				--limit $(TABLE_LIMIT) --batch-sizes 1,4,16,64 --methods $(SWEEP_METHODS) \
				--threads 1 --out out/sweep/$$m-$$p -q; \
		done; done

# Is the return to clean safe after what a deployed device meets? Each hostile stream (constant
# frames, a stuck frame, and the sensor-fault sweep: Gaussian noise of std 0.1-0.5, blur, JPEG)
# then clean images, one image per step, NoAdapt against EVA-0; one report per stream and seed
# (HOSTILE_SEEDS orders the stream and draws the perturbations; the table averages the seeds).
# HOSTILE_SET: overrides for EVA-0 (e.g. --set bank_slots=8), HOSTILE_OUT: the reports' folder.
HOSTILE_STREAMS := black repeat gauss-0.05 gauss-0.1 gauss-0.2 gauss-0.3 gauss-0.5 blur-1 blur-2 jpeg-20 jpeg-5
HOSTILE_LIMIT ?= 500
HOSTILE_SEEDS ?= 0 1 2 3 4
HOSTILE_SET ?=
HOSTILE_OUT ?= out/hostile
hostile: setup data
	for m in vit_fmnist resnet_gn_fmnist; do for s in $(HOSTILE_STREAMS); do \
		for seed in $(HOSTILE_SEEDS); do \
		$(VENV)/bin/eva0-edge eval --model models/$$m.onnx --protocol continual \
			--corruptions $$s,clean --batch-size 1 --limit $(HOSTILE_LIMIT) --seed $$seed \
			--methods noadapt,eva0 $(HOSTILE_SET) --threads 1 \
			--out $(HOSTILE_OUT)/$$m-$$s-seed$$seed -q; \
	done; done; done
	$(PY) -m eva0_edge.bench.hostile_summary $(HOSTILE_OUT)

# What a compute budget buys: the continual stream (severity 5) on both shipped models at B = 1
# and 64, NoAdapt / noadapt-shift / EVA-0 at full cost and EVA-0 at each of BUDGETS; the table
# and the Pareto plot of accuracy against the measured forwards per sample. BUDGET_METHOD=foa
# puts FOA under the budgets (add foa to BUDGET_REFERENCE), BUDGET_PROTOCOL=soak the stream ten
# times over.
BUDGETS ?= 1.5 1.25
BUDGET_LIMIT ?= 300
BUDGET_BATCHES ?= 1,64
BUDGET_METHOD ?= eva0
BUDGET_REFERENCE ?= noadapt,noadapt-shift,eva0
BUDGET_PROTOCOL ?= continual
BUDGET_MODELS ?= vit_fmnist resnet_gn_fmnist
BUDGET_OUT ?= out/budget
BUDGET_SEED ?= 0
budget: setup data
	for m in $(BUDGET_MODELS); do \
		$(VENV)/bin/eva0-edge eval --model models/$$m.onnx --protocol $(BUDGET_PROTOCOL) \
			--severity 5 --limit $(BUDGET_LIMIT) --batch-sizes $(BUDGET_BATCHES) \
			--methods $(BUDGET_REFERENCE) --seed $(BUDGET_SEED) --threads 1 \
			--out $(BUDGET_OUT)/$$m-full -q; \
		for f in $(BUDGETS); do \
			$(VENV)/bin/eva0-edge eval --model models/$$m.onnx --protocol $(BUDGET_PROTOCOL) \
				--severity 5 --limit $(BUDGET_LIMIT) --batch-sizes $(BUDGET_BATCHES) \
				--methods $(BUDGET_METHOD) --budget $$f --seed $(BUDGET_SEED) --threads 1 \
				--out $(BUDGET_OUT)/$$m-$$f -q; \
		done; done
	$(PY) -m eva0_edge.bench.budget_summary $(BUDGET_OUT)

# The Pareto report per protocol (issue 49): for every protocol of PARETO_PROTOCOLS at the
# severities PARETO_SEVERITIES (a list or range for --severity, each severity its own stream;
# gradual runs 1->5->1 by itself), BUDGET_REFERENCE at full cost and BUDGET_METHOD at each of
# BUDGETS, on PARETO_MODELS; each of PARETO_BANKS (domain-memory bank sizes, the config's
# bank_slots; empty: none) adds BUDGET_METHOD at full cost and at BUDGETS with that bank. The
# summary: a table row and a Pareto panel per model, protocol, severity and batch size
# (out/pareto/budget.md, .json, .png).
PARETO_PROTOCOLS ?= single continual imbalanced gradual mixed soak
PARETO_SEVERITIES ?= 1-5
PARETO_LIMIT ?= 300
PARETO_BATCHES ?= 1,16,64
PARETO_SOAK_PASSES ?= 10
PARETO_BANKS ?=
PARETO_MODELS ?= $(BUDGET_MODELS)
PARETO_OUT ?= out/pareto
pareto: setup data
	set -e; for m in $(PARETO_MODELS); do for p in $(PARETO_PROTOCOLS); do \
		sev=$$(test $$p = gradual || echo "--severity $(PARETO_SEVERITIES)"); \
		run="$(VENV)/bin/eva0-edge eval --model models/$$m.onnx --protocol $$p $$sev \
			--limit $(PARETO_LIMIT) --batch-sizes $(PARETO_BATCHES) \
			--soak-passes $(PARETO_SOAK_PASSES) --seed $(BUDGET_SEED) --threads 1 -q"; \
		$$run --methods $(BUDGET_REFERENCE) --out $(PARETO_OUT)/$$m-$$p-full; \
		for f in $(BUDGETS); do \
			$$run --methods $(BUDGET_METHOD) --budget $$f --out $(PARETO_OUT)/$$m-$$p-$$f; \
		done; \
		for b in $(PARETO_BANKS); do \
			$$run --methods $(BUDGET_METHOD) --set bank_slots=$$b \
				--out $(PARETO_OUT)/$$m-$$p-bank$$b-full; \
			for f in $(BUDGETS); do \
				$$run --methods $(BUDGET_METHOD) --set bank_slots=$$b --budget $$f \
					--out $(PARETO_OUT)/$$m-$$p-bank$$b-$$f; \
			done; done; done; done
	$(PY) -m eva0_edge.bench.budget_summary $(PARETO_OUT)

# Where to adapt: the cost of adapting fewer layers (random weights; ResNet50-GN: the last
# stage, stage 3 alone, the last two, the default stages 1-3, every GroupNorm; ViT-B: the last
# four blocks, the last six, the default 2-8; the split session runs the frozen layers before
# the first adapted one once per image), and what it keeps on the shipped models re-exported
# adapting the same sets: the ResNet-GN's stage 4, stage 3, stages 3-4, the 1-3 it ships with
# and every GroupNorm of its stages (1-4); the ViT's blocks 5-7 and 4-7 of its 8 (the last third
# and half, as 8-11 and 6-11 are of ViT-B's 12) and the 1-6 it ships with. Each is tuned by the
# rule on the validation split with the same budget (the shipped files' rates had five times
# the images), then evaluated on the test split (LAYERS_LIMIT images per corruption, at
# LAYERS_BATCHES). The summary writes out/layers/layers.md, .json and .png.
LAYER_SETS ?= resnet50_gn:4 resnet50_gn:3 resnet50_gn:3-4 resnet50_gn:1-3 resnet50_gn:1-4 \
	vit_base_patch16_224:8-11 vit_base_patch16_224:6-11 vit_base_patch16_224:2-8
SHIPPED_LAYER_SETS ?= resnet_gn_fmnist:1-4 resnet_gn_fmnist:1-3 resnet_gn_fmnist:3-4 \
	resnet_gn_fmnist:3 resnet_gn_fmnist:4 vit_fmnist:1-6 vit_fmnist:5-7 vit_fmnist:4-7
LAYERS_LIMIT ?= 1000
LAYERS_BATCHES ?= 1,16,64
layers: setup data
	mkdir -p out/layers
	for s in $(LAYER_SETS); do \
		arch=$${s%%:*}; a=$${s#*:}; f=out/layers/$$arch-$$a.onnx; \
		test -f $$f || $(VENV)/bin/eva0-edge export --arch $$arch --adapt $$a -o $$f -q; \
		$(VENV)/bin/eva0-edge bench --model $$f --methods noadapt,eva0 --batch-sizes 8,32 \
			--repeats 5 --no-memory --out out/layers/bench-$$arch-$$a -q; \
	done
	for s in $(SHIPPED_LAYER_SETS); do \
		arch=$${s%%:*}; a=$${s#*:}; \
		$(PY) models/recipes/layer_sets.py --arch $$arch --adapt $$a --out out/layers; \
		$(PY) models/recipes/tune.py --model out/layers/$$arch-$$a.onnx --method eva0 --write; \
	done
	for f in $(foreach s,$(SHIPPED_LAYER_SETS),out/layers/$(subst :,-,$(s)).onnx); do \
		for p in continual single; do \
			$(VENV)/bin/eva0-edge eval --model $$f --protocol $$p --severity 5 \
				--limit $(LAYERS_LIMIT) --batch-sizes $(LAYERS_BATCHES) \
				--methods noadapt,noadapt-shift,eva0 \
				--threads 1 --out out/layers/acc-$$(basename $$f .onnx)-$$p -q; \
		done; done
	$(PY) -m eva0_edge.bench.layers_summary out/layers

# Quantization: the shipped ViT as FP32 and PTQ4ViT W8A8 / W6A6, integer kernels and the
# fake-quant simulation (NoAdapt / EVA-0, clean and severity 5); ViT-B with random weights:
# file size, quantize time and peak RSS, and step time per batch size against FP32 NoAdapt.
QUANT_LIMIT ?= 1000
quant: setup data
	$(PY) -m eva0_edge.bench.quant_eval accuracy --model models/vit_fmnist.onnx \
		--limit $(QUANT_LIMIT) --threads 1 --out out/quant/vit_fmnist
	$(PY) -m eva0_edge.bench.quant_eval speed --arch vit_base_patch16_224 \
		--batch-sizes 1,8,32 --repeats 5 --warmup 1 --out out/quant/speed-vitb

# Tune every table method on the validation split, the same budget each (models/recipes/tune.py): the
# runtime methods on eva0's eta grid (0.5..16 x the pre-tuning value), the torch baselines on
# 0.5..16 x the paper's lr; the best past a grid edge is followed twice. Then the guard bounds.
ENGINE_METHODS := eva0 eva0-dagger zoa spsa2-shared
TORCH_METHODS := tent sar deyo
ETAS_vit_fmnist := 0.001,0.002,0.004,0.008,0.016,0.032
ETAS_resnet_gn_fmnist := 0.01,0.02,0.04,0.08,0.16,0.32
LIMIT_vit_fmnist := 200
LIMIT_resnet_gn_fmnist := 500
ETAS_mobilenet_bn_fmnist := 0.01,0.02,0.04,0.08,0.16,0.32
LIMIT_mobilenet_bn_fmnist := 500
tune: tune-vit_fmnist tune-resnet_gn_fmnist tune-mobilenet_bn_fmnist tune-bnstats
# the BatchNorm-statistics baselines' knobs (the BatchNorm model only)
tune-bnstats: setup data
	$(PY) models/recipes/tune.py --model models/mobilenet_bn_fmnist.onnx --method bn-adapt \
		--grid bn_prior=1,4,16,64,256 --limit 500 --clean-limit 1000 --write
	$(PY) models/recipes/tune.py --model models/mobilenet_bn_fmnist.onnx --method bn-ema \
		--grid bn_momentum=0.001,0.004,0.016,0.064 --extend 1 --limit 500 --clean-limit 1000 --write
tune-%: setup data
	for method in $(ENGINE_METHODS); do \
		$(PY) models/recipes/tune.py --model models/$*.onnx --method $$method --grid eta=$(ETAS_$*) \
			--limit $(LIMIT_$*) --clean-limit 1000 --write; \
	done
	for method in $(TORCH_METHODS); do \
		$(PY) models/recipes/tune.py --model models/$*.onnx --method $$method --limit $(LIMIT_$*) \
			--clean-limit 1000 --write; \
	done
	$(PY) models/recipes/guard_bounds.py --model models/$*.onnx --write
