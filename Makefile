# The two things a new user runs: `make demo` and `make test`. Both install the
# Debian packages first (scripts/setup.sh), then build with CMake and Ninja.
BUILD ?= build
CUDA ?= AUTO
JOBS ?= $(shell nproc)

.PHONY: all setup build test demo clean

all: build

setup:
	@bash scripts/setup.sh

$(BUILD)/build.ninja: CMakeLists.txt tests/CMakeLists.txt
	cmake -S . -B $(BUILD) -G Ninja -DMOETRAIN_CUDA=$(CUDA)

build: setup $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS)

# Tests run one at a time: each already uses every core through OpenMP, and two
# OpenMP programs spinning on the same cores slow each other down many times over.
test: build
	cd $(BUILD) && ctest --output-on-failure

demo: build
	@bash scripts/demo.sh $(BUILD)

clean:
	rm -rf $(BUILD)
