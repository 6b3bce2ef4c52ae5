"""SGLang-style programs over any SplitServe endpoint: ``@function`` programs build a prompt with ``s += text``,
role blocks (``system``, ``user``, ``assistant``, rendered with the served model's chat template), ``gen`` and
``select`` calls, and ``fork`` for parallel branches that share their prefix. Every call continues the exact token
sequence so far, so the server's radix cache serves every shared prefix. No torch: only httpx.

    from frontend import Endpoint, assistant, function, gen, user

    @function
    def qa(s, question):
        with s.user():
            s += question
        with s.assistant():
            s += gen("answer", max_tokens=64)

    state = qa.run(question="What is the capital of France?", backend=Endpoint("http://127.0.0.1:8000"))
    print(state["answer"])
"""
from frontend.backend import Endpoint, OpenAICompatible
from frontend.errors import FrontendError, ServerError, UnsupportedError
from frontend.ops import gen, image, select
from frontend.program import Program, function
from frontend.state import ProgramState

__all__ = ["Endpoint", "OpenAICompatible", "FrontendError", "Program", "ProgramState", "ServerError", "UnsupportedError", "function",
           "gen", "image", "select"]
