"""g4.convert"""
