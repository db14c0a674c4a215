import os

from services.agent.config import add_agent_arguments, make_runtime, options_from_args
from services.agent.service import Agent
from shared.service import base_parser, run_main

if __name__ == "__main__":
    parser = base_parser("Muster node agent: runs the tasks placed on this machine.")
    add_agent_arguments(parser)
    args = parser.parse_args()
    data_dir = os.environ.get("MUSTER_DATA_DIR", "/tmp/muster")

    def build():
        options = options_from_args(args, data_dir)
        return Agent.builder(options, make_runtime(args.runtime, os.path.join(options.work_root, "tasks")))

    run_main("agent", build, args)
