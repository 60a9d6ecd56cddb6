"""compare_servers ours,llamacpp with serve.py's usage parsing patched in-process: llama-server
puts `usage` in the last chunk that also carries `choices` (finish_reason), which serve.py's
`elif` skips. The patch reads usage from any chunk; everything else is serve.py's own code."""
import inspect, sys, textwrap
import benchmarks.serve as serve
src = textwrap.dedent(inspect.getsource(serve.send_completion))
old = "                elif data.get(\"usage\"):"
assert old in src
src = src.replace(old, "                if data.get(\"usage\"):")
ns = {}
exec(compile(src, serve.__file__, "exec"), serve.__dict__, ns)
serve.send_completion = ns["send_completion"]
from benchmarks import compare_servers
sys.exit(compare_servers.main(sys.argv[1:]))
