"""Generation: one interface, three backends (hf, vllm, openai), chosen by `generator.backend`.

`types` holds the interface, `backends.make_generator` picks a backend, `stage.GenerateStage` is a pass as a stage
and `passes.GeneratorPasses` runs a command's passes on its generator service. Nothing is re-exported: import from
the module that defines a name, so loading weights for training (`hf_loading` only) does not import the Ray stages.
"""
