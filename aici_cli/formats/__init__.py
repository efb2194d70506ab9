"""The line formats: what comes in, and in which format.

    jobs                 aici-batch's own input lines read and checked into `Job`s
    openai_batch         OpenAI batch requests (`vllm run-batch`'s format) in and out
    request_constraints  the constraint a batch request asks for, as a line's fields
    detect               `--format auto`: which of the two an input is
    schemas              the tool's own JSON Schemas (`schemas/`) and their validators
"""
