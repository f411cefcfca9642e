import sys

from neuron_constrain.cli import main

sys.exit(main())
