"""placeholder"""
FORMAT_KEY = "tpamp_megatron_format"
