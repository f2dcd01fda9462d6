"""mxmoe-pad: placeholder, replaced below."""
NAME = "mxmoe-pad"
def make(opt):
    def run(module_op):
        return None
    return run
