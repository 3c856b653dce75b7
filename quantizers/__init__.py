"""g4.quantizers"""
