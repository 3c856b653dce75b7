"""g4.exporters"""
