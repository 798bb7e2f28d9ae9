"""The parallel tests launch real gloo ranks through ``tests.support.ranks`` (the suite's one
launcher, with the port retry); a module's tests share launches through module fixtures."""
